"""A burst of Generate calls against the two daemons as real processes: every call ends OK or
RESOURCE_EXHAUSTED (a full queue), never CANCELLED. gRPC's core used to cancel calls that waited for the
server to take them once more than 1,000 waited (runtime.grpc_server.PENDING_CALLS), so that 8-12% of a
2,000-call burst ended with a bare CANCELLED, which clients do not retry."""

from __future__ import annotations

import asyncio
import collections
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.runtime.launch import start_decode, start_prefill
from kpool_pd.model.colocated import make_prompts
from kpool_pd.runtime import model_flags

TOKEN = "burst-client-token"
PEER_TOKEN = "burst-peer-token"
MODEL = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=5)
BURST = 2000


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("burst")
    prefill = start_prefill(workdir, model_flags(MODEL), transports="grpc", extra=["--peer-token", PEER_TOKEN])
    started = [prefill]
    try:
        prefill.wait_ready(120)
        decode = start_decode(workdir, model_flags(MODEL), [f"127.0.0.1:{prefill.port}"], transport="grpc",
                              extra=["--peer-token", PEER_TOKEN, "--token", TOKEN, "--max-queue", "4"])
        started.append(decode)
        decode.wait_ready(120)
        yield decode
    finally:
        for daemon in reversed(started):
            daemon.stop()


def _requests_counted(decode) -> dict[str, float]:
    """kpoolpd_decode_requests_total by outcome, as the decode daemon's /metrics says."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{decode.metrics_port}/metrics", timeout=10).read().decode()
    counted: dict[str, float] = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kpoolpd_decode_requests_total":
                counted[sample.labels.get("outcome", "")] += sample.value
    return counted


def test_a_burst_ends_only_ok_or_resource_exhausted_and_each_call_is_counted_once(decode):
    before = _requests_counted(decode)
    requests = make_prompts(BURST, 40, seed=0, vocab_size=1024, max_tokens=4)
    results = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", requests, token=TOKEN, timeout_s=120))
    codes = collections.Counter("OK" if not isinstance(r, RequestFailed) else r.code.name for r in results)
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert sum(codes.values()) == BURST
    refused = [r for r in results if isinstance(r, RequestFailed)]
    assert all("decode queue is full" in r.message for r in refused), collections.Counter(r.message[:40] for r in refused)
    after = _requests_counted(decode)
    counted = {outcome: after[outcome] - before.get(outcome, 0.0) for outcome in after}
    assert sum(counted.values()) == BURST, counted  # each call counted once, under one outcome
