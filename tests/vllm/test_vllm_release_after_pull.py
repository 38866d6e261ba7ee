"""A producer worker with ``release_after_pull`` (the default) ends a grant as soon as a pull has sent it all,
and its params say so: the consumer worker then sends no Release, and the producer's blocks go back to vLLM
long before the lease. A pull that fails before its bytes move keeps the grant for the consumer's Release.
The two workers run in this process over vLLM's own GLM-5-Next cache specs (no engine), over the gRPC
stream."""

from __future__ import annotations

import os
import secrets
import time

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.transfer_params import DecodeParams  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Offer, producer_params, released_after_pull  # noqa: E402
from tests.support.deadlines import patient  # noqa: E402
from tests.support.vllm_spec_caches import backing  # noqa: E402
from tests.support.vllm_spec_procs import spec_digest  # noqa: E402
from tests.support.vllm_worker_pair import HeldReleases, wait_finished, wait_freed, worker_pair  # noqa: E402

pytestmark = pytest.mark.vllm  # vLLM's config objects, a port of its own

DONE_S = 60.0  # a pull on a loaded 2-core machine
LEASE_S = 600.0  # far beyond the test: only the pull's end or a Release frees the blocks in time
SRC, DST = ((3, 4), (5,)), ((9, 10), (11,))  # a full group's two blocks and the ring's one


@pytest.fixture
def pair():
    producer, producer_caches, consumer, consumer_caches = worker_pair(LEASE_S, "after-pull")
    held = HeldReleases(producer)  # every Release is refused until the test lets them through
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


def offer_and_load(producer, consumer, request_id: str, *, error: str = "") -> dict:
    """Offer ``request_id`` on the producer and load it on the consumer with the params the producer's
    scheduler side hands out; ``error``: why the load cannot land (the scheduler side found, e.g., that the
    prompt is not the grant's): it fails before any byte moves. The params."""
    offer = Offer(request_id=request_id, grant_id=secrets.token_hex(16), block_ids=SRC, prompt_len=100,
                  prompt_digest=spec_digest(request_id, SRC))
    producer.offer(KpoolPdMetadata(offers=[offer]))
    params = producer_params(offer, address=producer.settings.advertise, engine_id=producer.engine_id,
                             lease_s=LEASE_S, released_after_pull=producer.settings.release_after_pull)
    consumer.load(KpoolPdMetadata(loads=[Load(request_id=request_id, params=DecodeParams.parse(params),
                                              block_ids=DST, digest=spec_digest(request_id, DST), error=error,
                                              released_after_pull=released_after_pull(params))]))
    return params


def test_a_pulled_grant_ends_with_its_last_byte_and_no_release_is_sent(pair):
    producer, producer_caches, consumer, consumer_caches, held = pair
    params = offer_and_load(producer, consumer, "pulled")
    assert released_after_pull(params), "the producer's params do not say it releases after the pull"
    done, failed = wait_finished(consumer, "pulled", DONE_S)
    assert done == {"pulled"} and failed == set()
    block = backing(producer_caches).numel() // 24  # NUM_BLOCKS blocks of every layer, one byte range each
    src, dst = backing(producer_caches), backing(consumer_caches)
    for theirs, ours in zip(SRC, DST):
        for s, d in zip(theirs, ours):
            assert bool((dst[d * block:(d + 1) * block] == src[s * block:(s + 1) * block]).all()), f"block {s}"
    assert wait_freed(producer, DONE_S) < DONE_S, "the pulled grant's blocks were not freed"
    assert producer.cache.allocations_held == 0
    deadline = time.monotonic() + patient(DONE_S)
    while "pulled" not in producer.finished_sending({"pulled"}) and time.monotonic() < deadline:
        producer.progress.wait_if_idle(KpoolPdMetadata(idle=True))
    assert time.monotonic() < deadline, "vLLM never heard that the producer's blocks are free"
    assert held.tries == 0, f"the consumer sent {held.tries} Release(s) for a grant the producer ended itself"


def test_a_load_that_fails_before_its_bytes_releases_the_grant(pair):
    """No byte was sent, so the producer holds the grant on; the consumer's Release gives it back, long
    before the lease."""
    producer, _, consumer, _, held = pair
    held.let_through()
    offer_and_load(producer, consumer, "refused", error="its prompt is not the one the producer's grant holds")
    done, failed = wait_finished(consumer, "refused", DONE_S)
    assert done == {"refused"} and failed == {"refused"}
    assert wait_freed(producer, DONE_S) < DONE_S and producer.cache.allocations_held == 0
    assert held.tries == 1, f"{held.tries} Releases for the failed load's grant, expected one"
