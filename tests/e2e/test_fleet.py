"""A fleet on one host, small enough for CI: two prefill and two decode daemons (CPU, the tiny model), eight
concurrent clients, skewed prompt lengths, least-loaded choice. Every reply equals the colocated run byte
for byte; afterwards no node holds a block, ring, grant or queued prompt and no lease expired. Then every
prefill daemon is killed at once under load and started again: each decode daemon answers SERVING within
5 s of the prefill daemons being ready, and no request sent after the kill fails.

The full fleet (8 + 8 daemons, 32 clients, 10,000 requests, round robin beside least-loaded, balanced beside
skewed) is ``kpool-pd bench fleet``; its results are under bench/results/."""

from __future__ import annotations

import logging

import pytest

from kpool_pd.bench.fleet_load import Workload
from kpool_pd.bench.fleet_run import FleetSpec, run_fleet
from kpool_pd.decode_worker.prefill_choice import PrefillPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_small_fleet_answers_byte_for_byte_holds_nothing_after_and_survives_a_prefill_restart(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kpool_pd.bench")
    spec = FleetSpec(prefill=2, decode=2, clients=8, policies=(PrefillPolicy.LEAST_LOADED,), balanced=False,
                     workload=Workload(requests=160, distinct=16, long=(256, 512), long_share=0.2),
                     restart_requests=160, kill_after=0.3)
    phases, problems = run_fleet(spec, tmp_path)
    assert problems == []
    skewed, restart = phases
    assert (skewed["phase"], skewed["ok"], skewed["mismatched"]) == ("least-loaded/skewed", 160, 0)
    assert sum(skewed["picks_per_prefill"]) == 160 and min(skewed["picks_per_prefill"]) > 0
    assert restart["phase"] == "restart" and restart["failed_after_kill"] == 0
    assert restart["ok"] + restart["failed_in_flight"] == 160 and restart["mismatched"] == 0
    assert len(restart["decode_serving_after_ready_s"]) == 2
    assert all(seconds <= 5.0 for seconds in restart["decode_serving_after_ready_s"].values())
