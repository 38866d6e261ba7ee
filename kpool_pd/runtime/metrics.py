"""A daemon's Prometheus ``/metrics`` endpoint: one registry, served over HTTP on its own thread."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kpool_pd.kvcache import NodeCache

logger = logging.getLogger(__name__)


class MetricsEndpoint:
    """Serves ``registry`` at ``http://host:port/metrics``. ``start`` once; ``close`` is idempotent
    and safe before ``start``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server = None
        self.port = -1

    def start(self, host: str, port: int) -> int:
        """Bind and serve (``port`` 0: any free port; below 0: no endpoint). Returns the bound port,
        or -1 when off."""
        if self._server is not None:
            raise RuntimeError("MetricsEndpoint.start may be called once")
        if port < 0:
            return -1
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server.handle_error = _quiet_error  # a client that resets its connection is not worth a traceback
        self.port = self._server.server_port
        return self.port

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _quiet_error(request, client_address) -> None:
    """A request that failed (most often: the client reset the connection) logs one debug line, not the
    traceback ``socketserver`` prints to stderr for each one, which a stream of resets would turn into
    megabytes of log."""
    logger.debug("metrics request from %s failed", client_address, exc_info=True)


def watch_cache(registry: CollectorRegistry, role: str, cache: NodeCache) -> None:
    """``kpoolpd_<role>_free_blocks`` and ``_free_rings``: the node cache's free counts, read when scraped."""
    Gauge(f"kpoolpd_{role}_free_blocks", "Free cache blocks", registry=registry).set_function(lambda: cache.free_blocks)
    Gauge(f"kpoolpd_{role}_free_rings", "Free ring blocks", registry=registry).set_function(lambda: cache.free_rings)
