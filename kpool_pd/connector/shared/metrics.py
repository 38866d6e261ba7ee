"""Prometheus metrics of one connector, registered in a registry the caller passes in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ConnectorMetrics:
    """``kpoolpd_<role>_*``: bytes and regions moved and transfer seconds by transport, failures
    by cause and expired leases (the node cache's free blocks and rings are its owner's: ``kpool_pd.runtime.metrics``)."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        p = f"kpoolpd_{role}"
        self.bytes = Counter(f"{p}_transfer_bytes", "Bytes moved by completed transfers", ["transport"], registry=registry)
        self.regions = Counter(f"{p}_transfer_regions", "Contiguous regions moved", ["transport"], registry=registry)
        self.seconds = Histogram(f"{p}_transfer_seconds", "Pull to last byte landed (decode) or sent (prefill)",
                                 ["transport"], buckets=TRANSFER_BUCKETS, registry=registry)
        self.failures = Counter(f"{p}_transfer_failures", "Failed transfers and refused calls by cause", ["cause"], registry=registry)
        self.leases_expired = Counter(f"{p}_leases_expired", "Grants freed because their lease ran out", registry=registry)
        if role == "decode":  # where a request's time to first token went before it reached this node
            self.prefill_seconds = Histogram(f"{p}_request_prefill_seconds", "A request's prompt on the prefill node, "
                                             "Prefill call to its last chunk computed", buckets=TRANSFER_BUCKETS,
                                             registry=registry)
            self.request_transfer_seconds = Histogram(f"{p}_request_transfer_seconds", "Moving all of a request's "
                                                      "bytes (pipelined: the time they were being sent)",
                                                      buckets=TRANSFER_BUCKETS, registry=registry)
            self.exposed_transfer_seconds = Histogram(f"{p}_request_exposed_transfer_seconds", "End of a request's "
                                                      "last prefill chunk to every byte landed here",
                                                      buckets=TRANSFER_BUCKETS, registry=registry)

    def transferred(self, transport: str, nbytes: int, regions: int, seconds: float) -> None:
        self.bytes.labels(transport).inc(nbytes)
        self.regions.labels(transport).inc(regions)
        self.seconds.labels(transport).observe(seconds)

    def request_times(self, times) -> None:
        """A landed request's ``kpool_pd.connector.decode.landed.TransferTimes`` (decode role)."""
        self.prefill_seconds.observe(times.prefill_ms / 1000)
        self.request_transfer_seconds.observe(times.transfer_ms / 1000)
        self.exposed_transfer_seconds.observe(times.exposed_transfer_ms / 1000)
