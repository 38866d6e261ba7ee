"""The router's Prometheus metrics, in a registry of its own (served on ``/metrics``). Each instance's picks,
picks by prefix affinity, outstanding requests and tokens, and failures are read from the pools at each
scrape, so instances found through DNS while the router runs appear (and those gone disappear) at once."""

from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
        self.registry.register(InstanceCollector(pools))

    def answered(self, endpoint: str, outcome: Outcome) -> None:
        self.requests.labels(endpoint, outcome.value).inc()

    def dropped(self, reason: DropReason) -> None:
        self._dropped.labels(reason.value).inc()


class InstanceCollector:
    """Each instance's counts, read from ``pools`` at each scrape (a custom collector: the instance set
    changes while the router runs)."""

    def __init__(self, pools: tuple[InstancePool, ...]) -> None:
        self._pools = pools

    def collect(self):
        labels = ["role", "instance"]
        families = {
            "picks": CounterMetricFamily("kpoolpd_router_instance_picks", "Requests sent to an instance",
                                         labels=labels),
            "affinity_picks": CounterMetricFamily("kpoolpd_router_instance_affinity_picks",
                                                  "Requests sent to an instance because their prompt's prefix went "
                                                  "there before", labels=labels),
            "outstanding": GaugeMetricFamily("kpoolpd_router_outstanding_requests", "Requests an instance has now",
                                             labels=labels),
            "outstanding_tokens": GaugeMetricFamily("kpoolpd_router_outstanding_tokens",
                                                    "Tokens of the requests an instance has now (prefill: prompt "
                                                    "tokens; decode: prompt and max_tokens)", labels=labels),
            "up": GaugeMetricFamily("kpoolpd_router_instance_up", "1 while an instance is up (not failed lately, "
                                    "not down)", labels=labels),
        }
        for pool in self._pools:
            for instance in pool.instances:
                values = [pool.role.value, instance.url]
                for name in ("picks", "affinity_picks", "outstanding", "outstanding_tokens"):
                    families[name].add_metric(values, getattr(instance, name))
                families["up"].add_metric(values, 0 if pool.cooling(instance) else 1)
        yield from families.values()
