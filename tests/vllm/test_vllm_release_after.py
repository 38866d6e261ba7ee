"""A consumer worker (``kpool_pd.vllm.consumer_worker.ConsumerWorker``) reports a pull finished as soon as its
bytes landed, and releases the producer's grant in the background: a Release the producer does not answer
is sent again until it is answered (the producer's blocks then go back at once), and one that is never
answered leaves them held no longer than the producer's lease. The two workers run in this process over
vLLM's own GLM-5-Next cache specs (no engine), over the gRPC stream."""

from __future__ import annotations

import os
import secrets
import time

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.transfer_params import DecodeParams  # noqa: E402
from kpool_pd.vllm.consumer_worker import ConsumerWorker  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Offer, producer_params  # noqa: E402
from kpool_pd.vllm.producer_worker import ProducerWorker  # noqa: E402
from tests.support.deadlines import patient  # noqa: E402
from tests.support.vllm_spec_caches import backing  # noqa: E402
from tests.support.vllm_spec_procs import spec_digest  # noqa: E402
from tests.support.vllm_worker_pair import HeldReleases, wait_finished, wait_freed, worker_pair  # noqa: E402

pytestmark = pytest.mark.vllm  # vLLM's config objects, a port of its own

DONE_S = 60.0  # a pull, a Release's retries, on a loaded 2-core machine
SRC, DST = ((3, 4), (5,)), ((9, 10), (11,))  # a full group's two blocks and the ring's one


@pytest.fixture
def pair(request):
    producer, producer_caches, consumer, consumer_caches = worker_pair(request.param, "release", release_after_pull=False)
    held = HeldReleases(producer)
    started = []
    try:
        for worker in (producer, consumer):
            worker.start()
            started.append(worker)
        yield producer, producer_caches, consumer, consumer_caches, held
    finally:
        held.let_through()
        for worker in reversed(started):
            worker.close()


def offer_and_load(producer: ProducerWorker, consumer: ConsumerWorker, request_id: str, lease_s: float) -> None:
    offer = Offer(request_id=request_id, grant_id=secrets.token_hex(16), block_ids=SRC, prompt_len=100,
                  prompt_digest=spec_digest(request_id, SRC))
    producer.offer(KpoolPdMetadata(offers=[offer]))
    params = DecodeParams.parse(producer_params(offer, address=producer.settings.advertise,
                                                engine_id=producer.engine_id, lease_s=lease_s))
    consumer.load(KpoolPdMetadata(loads=[Load(request_id=request_id, params=params, block_ids=DST,
                                              digest=spec_digest(request_id, DST))]))


LONG_LEASE_S = 600.0  # far beyond the test: only an answered Release frees the blocks in time


@pytest.mark.parametrize("pair", [LONG_LEASE_S], indirect=True)
def test_a_pull_is_reported_before_its_release_and_the_release_is_sent_until_answered(pair):
    producer, producer_caches, consumer, consumer_caches, held = pair
    offer_and_load(producer, consumer, "landed", LONG_LEASE_S)
    done, failed = wait_finished(consumer, "landed", DONE_S)
    assert done == {"landed"} and failed == set()
    tries_when_reported = held.tries
    block = backing(producer_caches).numel() // 24  # NUM_BLOCKS blocks of every layer, one byte range each
    src, dst = backing(producer_caches), backing(consumer_caches)
    for theirs, ours in zip(SRC, DST):
        for s, d in zip(theirs, ours):
            assert bool((dst[d * block:(d + 1) * block] == src[s * block:(s + 1) * block]).all()), f"block {s}"
    assert producer.cache.allocations_held == 1, "vLLM heard of the pull only once the grant was released"
    assert tries_when_reported <= 2, f"the pull was reported after {tries_when_reported} tries of its Release"
    deadline = time.monotonic() + patient(DONE_S)
    while held.tries < 2 and time.monotonic() < deadline:  # refused, then sent again
        time.sleep(0.02)
    assert held.tries >= 2 and producer.cache.allocations_held == 1
    held.let_through()
    assert wait_freed(producer, DONE_S) < DONE_S, "the answered Release did not free the producer's blocks"
    assert producer.cache.allocations_held == 0


SHORT_LEASE_S = 2.0


@pytest.mark.parametrize("pair", [SHORT_LEASE_S], indirect=True)
def test_a_release_never_answered_holds_the_blocks_no_longer_than_the_lease(pair):
    producer, _, consumer, _, held = pair
    offer_and_load(producer, consumer, "unanswered", SHORT_LEASE_S)
    done, failed = wait_finished(consumer, "unanswered", DONE_S)
    assert done == {"unanswered"} and failed == set()
    assert wait_freed(producer, DONE_S) < DONE_S and producer.cache.allocations_held == 0
    assert held.tries >= 2  # every Release was refused, and sent again
    assert producer.take_stats().data["leases_expired"] == 1  # the lease freed the blocks
