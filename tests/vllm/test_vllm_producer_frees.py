"""A producer worker gives vLLM back every offered request's blocks (``kpool_pd.vllm.worker.ProducerWorker``),
without engines: in a pool of head units each request is held as its whole grant and one grant per head
slot, and the whole grant's release (the consumer's Release after its pull) releases that request's own
unclaimed slot grants, also when several requests were offered in one step (prompts computed together, as
concurrent requests are); ``finished_sending`` then reports every one of them to vLLM."""

from __future__ import annotations

import json
import os
import secrets

import pytest
import torch

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.connector import prefill_api as pb  # noqa: E402
from kpool_pd.kvcache import PlanarCacheConfig, PlanarLayout, PlanarPool  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata, Offer  # noqa: E402
from kpool_pd.vllm.settings import KpoolPdSettings  # noqa: E402
from kpool_pd.vllm.worker import ProducerWorker  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.vllm_worker_pair import offer_held  # noqa: E402

UNITS = 2  # head slots a block holds: a whole grant and two slot grants a request
NUM_UNITS = 32  # the pool's units (16 vLLM blocks of two slots)
PLANE_BYTES = (64, 64)
REQUESTS = {"a": ((1, 2),), "b": ((3, 4),), "c": ((5,),)}  # vLLM's block ids of each request (one group)


def head_unit_pool() -> PlanarPool:
    """A pool of head units (two slots a vLLM block) of two small planes."""
    config = PlanarCacheConfig(block_size=16, plane_block_bytes=PLANE_BYTES,
                               description=json.dumps({"engine": "producer-frees-test"}))
    return PlanarPool(PlanarLayout(config), [torch.zeros(NUM_UNITS * n, dtype=torch.uint8) for n in PLANE_BYTES],
                      num_blocks=NUM_UNITS)


@pytest.fixture
def producer():
    settings = KpoolPdSettings.from_extra_config({"listen": f"127.0.0.1:{free_port()}", "lease_s": 600},
                                                 producer=True)
    worker = ProducerWorker(settings, head_unit_pool(), engine_id="frees-producer", model_identity="test",
                            units=UNITS)
    try:
        yield worker
    finally:
        worker.close()


def offers() -> list[Offer]:
    return [Offer(request_id=rid, grant_id=secrets.token_hex(16), block_ids=blocks, prompt_len=20,
                  prompt_digest=secrets.token_hex(32)) for rid, blocks in REQUESTS.items()]


def release_whole(producer: ProducerWorker, offer: Offer) -> None:
    """The whole grant's end, as the consumer's Release after its pull ends it (on the connector's loop),
    then one more turn of the loop: the slot grants it releases go back in a callback of their own."""
    async def release():
        assert producer.node.grants.release(pb.ReleaseRequest(grant_id=offer.key)).released

    async def turn():
        return None

    producer.loop.call(release)
    producer.loop.call(turn)


def test_requests_offered_in_one_step_each_free_their_own_slot_grants(producer):
    """Three requests offered in one step's metadata, their whole grants released one by one: each release
    frees its own request's slot grants (not the last offered request's), and vLLM gets each request's
    blocks back once it finished."""
    step = offers()
    offer_held(producer, KpoolPdMetadata(offers=step))
    assert producer.cache.allocations_held == len(step) * (1 + UNITS)
    finished = set(REQUESTS)
    assert producer.finished_sending(finished) == set()  # no grant ended yet
    freed = set()
    for offer in step:
        release_whole(producer, offer)
        freed |= producer.finished_sending(set())
        assert offer.request_id in freed, f"request {offer.request_id}'s slot grants were not released"
    assert freed == finished
    assert producer.cache.allocations_held == 0
    assert producer.take_stats().data["grants_offered"] == len(step)


def test_a_request_offered_alone_frees_its_blocks_once_vllm_finished_it(producer):
    """One request: its blocks go back to vLLM only once the grant ended and vLLM said it finished, in either
    order."""
    (offer, *_) = offers()
    offer_held(producer, KpoolPdMetadata(offers=[offer]))
    release_whole(producer, offer)
    assert producer.cache.allocations_held == 0
    assert producer.finished_sending(set()) == set()  # vLLM has not finished it yet
    assert producer.finished_sending({offer.request_id}) == {offer.request_id}
    assert producer.finished_sending({offer.request_id}) == set()  # reported once


def test_an_offer_of_blocks_beyond_the_pool_holds_nothing_and_the_next_offer_is_held(producer):
    """A request whose block ids lie past the pool (16 vLLM blocks here) cannot be lent: its grants count as
    ended, so vLLM gets it back as soon as it finished it, and the loop goes on to lend the next step's offer."""
    bad = Offer(request_id="beyond", grant_id=secrets.token_hex(16), block_ids=((15, 99),), prompt_len=20,
                prompt_digest=secrets.token_hex(32))
    offer_held(producer, KpoolPdMetadata(offers=[bad]))
    assert producer.cache.allocations_held == 0
    assert producer.finished_sending({"beyond"}) == {"beyond"}
    (good, *_) = offers()
    offer_held(producer, KpoolPdMetadata(offers=[good]))
    assert producer.cache.allocations_held == 1 + UNITS
    release_whole(producer, good)
    assert producer.finished_sending({good.request_id}) == {good.request_id}
    assert producer.take_stats().data["grants_offered"] == 2
