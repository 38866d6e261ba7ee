"""A decode request that waits in the consumer's queue keeps its grant, however long it waits: the consumer
worker (``kpool_pd.vllm.worker.ConsumerWorker``) renews the grant of each request vLLM told it about
(``on_new_request``: a ``Renew`` in the step's metadata) until its load begins, and the pull then lands the
blocks byte for byte, several of the producer's leases after the offer. A grant whose request is released
stops being renewed. The two workers run in this process over vLLM's own GLM-5-Next cache specs (no
engine), over the gRPC stream."""

from __future__ import annotations

import os
import secrets
import time

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.transfer_params import DecodeParams  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Offer, Release, Renew, producer_params  # noqa: E402
from kpool_pd.vllm.worker import ConsumerWorker, ProducerWorker  # noqa: E402
from tests.support.deadlines import patient  # noqa: E402
from tests.support.vllm_spec_caches import backing  # noqa: E402
from tests.support.vllm_spec_procs import spec_digest  # noqa: E402
from tests.support.vllm_worker_pair import offer_held, started, wait_finished, worker_pair  # noqa: E402

pytestmark = pytest.mark.vllm  # vLLM's config objects, a port of its own, timing over several leases

LEASE_S = 1.0  # the producer's: the queue below outlasts it several times
QUEUED_S = 4 * LEASE_S
DONE_S = 60.0
SRC, DST = ((3, 4), (5,)), ((9, 10), (11,))  # a full group's two blocks and the ring's one


@pytest.fixture
def workers():
    producer, producer_caches, consumer, consumer_caches = worker_pair(LEASE_S, "renew")
    with started(producer, consumer):
        yield producer, producer_caches, consumer, consumer_caches


def offer(producer: ProducerWorker, request_id: str) -> dict:
    offer = Offer(request_id=request_id, grant_id=secrets.token_hex(16), block_ids=SRC, prompt_len=100,
                  prompt_digest=spec_digest(request_id, SRC))
    offer_held(producer, KpoolPdMetadata(offers=[offer]))
    return producer_params(offer, address=producer.settings.advertise, engine_id=producer.engine_id,
                           lease_s=LEASE_S)


def test_a_queued_requests_grant_outlives_its_lease_and_lands(workers):
    producer, producer_caches, consumer, consumer_caches = workers
    params = DecodeParams.parse(offer(producer, "queued"))
    consumer.load(KpoolPdMetadata(renewals=[Renew(request_id="queued", address=params.address, key=params.key,
                                                  lease_s=params.lease_s)]))
    waited_until = time.monotonic() + QUEUED_S  # the request waits in vLLM's queue this long
    while time.monotonic() < waited_until:
        assert producer.cache.allocations_held == 1, "the queued request's grant expired"
        time.sleep(0.05)
    consumer.load(KpoolPdMetadata(loads=[Load(request_id="queued", params=params, block_ids=DST,
                                              digest=spec_digest("queued", DST))]))
    done, failed = wait_finished(consumer, "queued", DONE_S)
    assert "queued" in done and failed == set()
    assert "queued" not in consumer.renewing()
    counts = consumer.take_stats().data  # what vLLM's /metrics gets (kpool_pd.vllm.stats)
    assert counts["pulls"] == 1 and counts["pulled_bytes"] > 0 and counts["pull_failures"] == 0
    assert counts["grants_renewed"] >= 2, counts  # four leases long, renewed at a third of one
    assert producer.take_stats().data["grants_offered"] == 1
    block = backing(producer_caches).numel() // 24  # NUM_BLOCKS blocks of every layer, one byte range each
    src, dst = backing(producer_caches), backing(consumer_caches)
    for theirs, ours in zip(SRC, DST):
        for s, d in zip(theirs, ours):
            assert bool((dst[d * block:(d + 1) * block] == src[s * block:(s + 1) * block]).all()), f"block {s}"


def test_a_released_requests_grant_is_no_longer_renewed(workers):
    producer, _, consumer, _ = workers
    params = DecodeParams.parse(offer(producer, "gone"))
    consumer.load(KpoolPdMetadata(renewals=[Renew(request_id="gone", address=params.address, key=params.key,
                                                  lease_s=params.lease_s)]))
    assert consumer.renewing() == {"gone"}
    consumer.load(KpoolPdMetadata(releases=[Release(request_id="gone", address=params.address, key=params.key,
                                                    why="the test aborted it")]))
    assert consumer.renewing() == set()
    deadline = time.monotonic() + patient(DONE_S)
    while producer.cache.allocations_held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert producer.cache.allocations_held == 0, "the released grant still holds the producer's blocks"
    deadline = time.monotonic() + patient(DONE_S)
    counts = {}
    while not counts.get("grants_released") and time.monotonic() < deadline:  # counted once its answer came
        taken = consumer.take_stats()
        counts = taken.data if taken is not None else counts
        time.sleep(0.05)
    assert counts.get("grants_released") == 1, counts
