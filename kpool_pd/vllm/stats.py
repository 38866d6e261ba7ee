"""The connector's counters as vLLM's own ``KVConnectorStats``: the worker side records them
(``StatsRecorder``), vLLM collects them every step (``KpoolPdConnector.get_kv_connector_stats``), sums them
across workers (``KpoolPdStats.aggregate``), logs them (``reduce``) and exports them on its own ``/metrics``
(``KpoolPdPromMetrics``, built by ``KpoolPdConnector.build_prom_metrics``), per engine:

| metric | what |
|---|---|
| ``vllm:kpool_pd_pulls_total`` | pulls that landed (consumer) |
| ``vllm:kpool_pd_pull_failures_total`` | pulls that failed, the request reported failed to vLLM (consumer) |
| ``vllm:kpool_pd_pulled_bytes_total`` | bytes those pulls landed (consumer) |
| ``vllm:kpool_pd_pulled_regions_total`` | contiguous regions (messages) those pulls moved (consumer) |
| ``vllm:kpool_pd_pull_seconds`` | histogram: one pull, from its start to its last byte (consumer) |
| ``vllm:kpool_pd_grants_released_total`` | grants given back unpulled: rejected, aborted, prefix hits, failures (consumer) |
| ``vllm:kpool_pd_grants_renewed_total`` | lease renewals of queued requests' grants (consumer) |
| ``vllm:kpool_pd_grants_offered_total`` | prompts held as grants (producer) |
| ``vllm:kpool_pd_grants_withdrawn_total`` | offered prompts whose request ended unanswered (aborted): freed at once (producer) |
| ``vllm:kpool_pd_leases_expired_total`` | grants freed because no consumer came within the lease (producer) |
| ``vllm:kpool_pd_grants_announced_total`` | grants announced to the consumer their request named (``prefetch_by``) (producer) |
| ``vllm:kpool_pd_grants_prefetched_total`` | announced grants pulled before their request arrived (consumer) |
| ``vllm:kpool_pd_prefetch_hits_total`` | loads served from prefetched bytes, no pull of their own (consumer) |
| ``vllm:kpool_pd_prefetches_expired_total`` | prefetched grants dropped unclaimed after their lease (consumer) |
| ``vllm:kpool_pd_prefetches_skipped_total`` | announced grants left to their pulls: ``prefetch_mib`` was full (consumer) |
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTS = ("pulls", "pull_failures", "pulled_bytes", "pulled_regions", "pulled_blocks", "held_blocks",
          "grants_released", "grants_renewed", "grants_offered", "grants_withdrawn", "leases_expired",
          "grants_announced", "grants_prefetched", "prefetch_hits", "prefetches_expired", "prefetches_skipped")
SECONDS = "pull_seconds"  # one value a pull
PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _empty() -> dict[str, Any]:
    return {**{name: 0 for name in COUNTS}, SECONDS: []}


@dataclass
class KpoolPdStats(KVConnectorStats):
    """One interval's counts (``COUNTS``) and pull times (``SECONDS``), as plain data vLLM can serialise."""

    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        self.data = _empty() | dict(self.data or {})

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> "KpoolPdStats":
        theirs = other.data
        for name in COUNTS:
            self.data[name] += int(theirs.get(name, 0))
        self.data[SECONDS] = [*self.data[SECONDS], *theirs.get(SECONDS, [])]
        return self

    def reduce(self) -> dict[str, int | float]:
        times = self.data[SECONDS]
        summary: dict[str, int | float] = {name: self.data[name] for name in COUNTS if name not in
                                           ("pulled_bytes", "pulled_regions")}
        summary["pulled_MiB"] = round(self.data["pulled_bytes"] / 2**20, 3)
        summary["avg_pull_ms"] = round(1000 * sum(times) / len(times), 3) if times else 0.0
        return summary

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTS) and not self.data[SECONDS]


class StatsRecorder:
    """The worker side's counts since vLLM last collected them; any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KpoolPdStats()

    def count(self, name: str, amount: int = 1) -> None:
        if name not in COUNTS:
            raise ValueError(f"no count {name!r}; counts: {COUNTS}")
        with self._lock:
            self._stats.data[name] += amount

    def pulled(self, nbytes: int, regions: int, seconds: float, *, blocks: int = 0, held: int = 0) -> None:
        with self._lock:
            data = self._stats.data
            data["pulls"] += 1
            data["pulled_bytes"] += nbytes
            data["pulled_regions"] += regions
            data["pulled_blocks"] += blocks
            data["held_blocks"] += held
            data[SECONDS].append(seconds)

    def take(self) -> KpoolPdStats | None:
        """The counts since the last call (None when there are none), and a fresh start."""
        with self._lock:
            taken, self._stats = self._stats, KpoolPdStats()
        return None if taken.is_empty() else taken


class KpoolPdPromMetrics(KVConnectorPromMetrics):
    """The counters and the pull-time histogram on vLLM's ``/metrics``, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        about = {"pulls": "Pulls that landed a request's KV", "pull_failures": "Pulls that failed",
                 "pulled_bytes": "Bytes pulls landed", "pulled_regions": "Contiguous regions pulls moved",
                 "pulled_blocks": "Blocks pulls landed (every KV cache group's, the ring's included)",
                 "held_blocks": "Prompt blocks not pulled: this engine's prefix cache held them",
                 "grants_released": "Producer grants given back unpulled",
                 "grants_renewed": "Lease renewals of queued requests' grants",
                 "grants_offered": "Prompts held as grants for consumers",
                 "grants_withdrawn": "Offered prompts whose request ended unanswered, freed at once",
                 "leases_expired": "Grants freed because no consumer came within the lease",
                 "grants_announced": "Grants announced to the consumer their request named",
                 "grants_prefetched": "Announced grants pulled before their request arrived",
                 "prefetch_hits": "Loads served from prefetched bytes",
                 "prefetches_expired": "Prefetched grants dropped unclaimed after their lease",
                 "prefetches_skipped": "Announced grants left to their pulls: the prefetch budget was full"}
        self._counters = {name: create_metric_per_engine(
            self._counter_cls(name=f"vllm:kpool_pd_{name}", documentation=about[name], labelnames=labelnames),
            per_engine_labelvalues) for name in COUNTS}
        self._pull_seconds = create_metric_per_engine(
            self._histogram_cls(name="vllm:kpool_pd_pull_seconds", documentation="One pull, start to last byte",
                                buckets=list(PULL_BUCKETS), labelnames=labelnames), per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTS:
            amount = transfer_stats_data.get(name, 0)
            if amount:
                self._counters[name][engine_idx].inc(amount)
        for seconds in transfer_stats_data.get(SECONDS, []):
            self._pull_seconds[engine_idx].observe(seconds)
