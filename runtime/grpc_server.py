"""The gRPC server of a daemon: bearer-token auth, TLS, grpc.health.v1, reflection, and an
optional plaintext health port.

Servicers are registered with ``add`` before ``start``; each is an object with a
``service_name`` (the full protobuf name) and ``add_to_server(server)``. Health is reported for
every added service and for the server as a whole (service ``""``); it starts as NOT_SERVING
until ``set_serving(True)`` (a daemon calls it once warmed up), and ``stop`` leaves it
NOT_SERVING. The health port serves the same health servicer alone, in plaintext, for probes that
cannot speak TLS (the kubelet's gRPC probes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from connector import BearerTokenInterceptor, TlsConfig

logger = logging.getLogger(__name__)


class Servicer(Protocol):
    """A gRPC service implementation as the server registers it."""

    service_name: str  # the full protobuf name, e.g. "kpoolpd.v1.PrefillService"

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the service's handlers on ``server``."""


class GrpcServer:
    """One daemon's gRPC server. ``start`` once, ``stop`` is idempotent; one event loop."""

    def __init__(self, *, token: str | None = None, tls: TlsConfig | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        if token is not None and not token:
            raise ValueError("token must be None (no auth) or a non-empty string")
        self.tls = tls
        interceptors = [BearerTokenInterceptor(token)] if token else []
        self._server = grpc.aio.server(interceptors=interceptors, options=list(options))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._services: list[str] = []
        self._serving = False
        self._started = False
        self._stopped = False
        self._probe_server: grpc.aio.Server | None = None
        self.port = -1
        self.health_port = -1

    @property
    def services(self) -> tuple[str, ...]:
        return tuple(self._services)

    def add(self, servicer: Servicer) -> None:
        """Register ``servicer`` (before ``start``)."""
        if self._started:
            raise RuntimeError(f"add {servicer.service_name} before start")
        servicer.add_to_server(self._server)
        self._services.append(servicer.service_name)

    async def start(self, host: str, port: int, *, health_port: int = -1) -> int:
        """Bind ``host:port`` (0: a free port) and, when ``health_port >= 0``, the plaintext health
        port; serve; return the bound gRPC port (``self.health_port`` holds the other, or -1)."""
        if self._started:
            raise RuntimeError("GrpcServer.start may be called once")
        self._started = True
        reflection.enable_server_reflection((*self._services, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self._server)
        address = f"{host}:{port}"
        self.port = (self._server.add_secure_port(address, self.tls.server_credentials()) if self.tls
                     else self._server.add_insecure_port(address))
        await self._server.start()
        if health_port >= 0:
            self._probe_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._probe_server)
            self.health_port = self._probe_server.add_insecure_port(f"{host}:{health_port}")
            await self._probe_server.start()
        await self._report_health()
        return self.port

    @property
    def serving(self) -> bool:
        return self._serving

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING (True) or NOT_SERVING (False) for every service and the server; any
        number of times, before or after ``start`` (``start`` reports the last value set). Changes
        no RPC's behaviour."""
        if not isinstance(serving, bool):
            raise TypeError(f"serving must be a bool, got {serving!r}")
        self._serving = serving
        if self._started and not self._stopped:
            await self._report_health()

    async def _report_health(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self._serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self._services):
            await self._health.set(name, status)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Report NOT_SERVING, then stop both servers (calls in flight get ``grace`` seconds)."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._probe_server is not None:
            await self._probe_server.stop(None)
