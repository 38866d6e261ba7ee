"""The connector's counters as vLLM's ``KVConnectorStats`` (``kpool_pd.vllm.stats``): recorded, taken once,
summed across workers, reduced for vLLM's log line, and observed into Prometheus metrics per engine."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kpool_pd.vllm import KpoolPdConnector  # noqa: E402
from kpool_pd.vllm.stats import KpoolPdPromMetrics, KpoolPdStats, StatsRecorder  # noqa: E402


def test_counts_are_taken_once_and_summed_across_workers():
    one, two = StatsRecorder(), StatsRecorder()
    assert one.take() is None  # nothing counted: nothing for vLLM to log
    one.pulled(nbytes=3 * 2**20, regions=4, seconds=0.010, blocks=3, held=2)
    one.count("grants_released")
    two.pulled(nbytes=2**20, regions=2, seconds=0.030)
    two.count("pull_failures", 2)
    first, second = one.take(), two.take()
    assert one.take() is None
    total = KpoolPdConnector.build_kv_connector_stats(first.to_dict()).aggregate(second)
    assert total.reduce() == {"pulls": 2, "pull_failures": 2, "pulled_blocks": 3, "held_blocks": 2,
                              "grants_released": 1, "grants_renewed": 0, "grants_offered": 0, "grants_withdrawn": 0,
                              "leases_expired": 0, "grants_announced": 0, "grants_prefetched": 0, "prefetch_hits": 0,
                              "prefetches_expired": 0, "prefetches_skipped": 0,
                              "pulled_MiB": 4.0, "avg_pull_ms": 20.0}
    assert not total.is_empty() and KpoolPdStats().is_empty()
    with pytest.raises(ValueError, match="no count"):
        one.count("pulls_of_the_moon")


def test_the_prometheus_metrics_count_per_engine():
    registry = CollectorRegistry()

    def of(kind):
        return lambda **kwargs: kind(registry=registry, **kwargs)
    metrics = KpoolPdPromMetrics(vllm_config=type("Config", (), {"kv_transfer_config": None})(),
                                 metric_types={Counter: of(Counter), Gauge: of(Gauge), Histogram: of(Histogram)},
                                 labelnames=["model_name", "engine"],
                                 per_engine_labelvalues={0: ["m", "0"], 1: ["m", "1"]})
    recorder = StatsRecorder()
    recorder.pulled(nbytes=1000, regions=3, seconds=0.002)
    recorder.pulled(nbytes=500, regions=1, seconds=0.2)
    recorder.count("grants_renewed", 5)
    metrics.observe(recorder.take().to_dict(), engine_idx=1)
    labels = {"model_name": "m", "engine": "1"}
    assert registry.get_sample_value("vllm:kpool_pd_pulls_total", labels) == 2
    assert registry.get_sample_value("vllm:kpool_pd_pulled_bytes_total", labels) == 1500
    assert registry.get_sample_value("vllm:kpool_pd_pulled_regions_total", labels) == 4
    assert registry.get_sample_value("vllm:kpool_pd_grants_renewed_total", labels) == 5
    assert registry.get_sample_value("vllm:kpool_pd_pull_seconds_count", labels) == 2
    assert registry.get_sample_value("vllm:kpool_pd_pull_seconds_bucket", labels | {"le": "0.0025"}) == 1
    assert registry.get_sample_value("vllm:kpool_pd_pulls_total", {"model_name": "m", "engine": "0"}) == 0
