"""The router's Prometheus metrics, in a registry of its own (served on ``/metrics``)."""

from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kpool_pd.router.instances import InstancePool
from kpool_pd.router.intake import DropReason


class Outcome(enum.Enum):
    OK = "ok"
    CLIENT_ERROR = "client_error"     # the request was refused (by the router or an instance: 4xx), or the client left
    UPSTREAM_ERROR = "upstream_error"  # every instance of a role failed, or the decode stream broke or carried an error


class RouterMetrics:
    def __init__(self, pools: tuple[InstancePool, ...]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kpoolpd_router_requests", "Requests the router answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.instance_failures = Counter("kpoolpd_router_instance_failures",
                                         "Requests an instance failed (the router tried another)",
                                         ["role", "instance"], registry=self.registry)
        self.prefill_seconds = Histogram("kpoolpd_router_prefill_seconds", "Prefill requests, from send to answer",
                                         registry=self.registry)
        self.first_byte_seconds = Histogram("kpoolpd_router_first_byte_seconds",
                                            "From a request's arrival to the first byte of its decode answer",
                                            registry=self.registry)
        self.grants_released = Counter("kpoolpd_router_grants_released",
                                       "Prefill grants released because their decode could not happen, by result",
                                       ["released"], registry=self.registry)
        self.client_connections = Gauge("kpoolpd_router_client_connections", "Client connections held now",
                                        registry=self.registry)
        self._dropped = Counter("kpoolpd_router_client_connections_dropped",
                                "Client connections the router closed, by reason", ["reason"], registry=self.registry)
        outstanding = Gauge("kpoolpd_router_outstanding_requests", "Requests an instance has now",
                            ["role", "instance"], registry=self.registry)
        for pool in pools:
            for instance in pool.instances:
                outstanding.labels(pool.role.value, instance.url).set_function(lambda i=instance: i.outstanding)

    def answered(self, endpoint: str, outcome: Outcome) -> None:
        self.requests.labels(endpoint, outcome.value).inc()

    def dropped(self, reason: DropReason) -> None:
        self._dropped.labels(reason.value).inc()
