"""A grant the prefill engine offers itself (``PrefillConnector.offer``: an engine that schedules its own
requests, as vLLM's producer does), between two engines whose caches are planes of their own tensors
(``kvcache.PlanarPool``, blocks lent by ``kvcache.EngineCache``), in the test's event loop over the gRPC
stream: the first handshaken decode engine that names the grant claims it and pulls it byte for byte
into its own blocks, and the engine's blocks go back when the grant ends (released, or its lease ran
out unclaimed); another engine is refused and moves no byte; a bad offer holds nothing."""

from __future__ import annotations

import asyncio
import json
import secrets

import pytest
import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import (
    ConnectorConfig,
    DecodeConnector,
    EngineUnavailable,
    PrefillConnector,
    PrefillGrant,
    RingRange,
    StatusError,
    Transport,
)
from kpool_pd.kvcache import EngineCache, PlanarCacheConfig, PlanarLayout, PlanarPool
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.serving import serve_prefill, stop_prefill

TOKEN = "offer-test-token"
BLOCK_SIZE = 16
NUM_BLOCKS = 16
PLANE_BYTES = (512, 512, 256)  # e.g. one layer's K and V, and another buffer of its own size
POISON = 0x5A


class NoPrefillCalls:
    """The engine schedules its own prompts: it answers no Prefill call."""

    async def prefill(self, request, progress):
        raise EngineUnavailable("this engine offers its grants itself")


def planes(seed: int | None) -> PlanarPool:
    """A pool of three planes: seeded random bytes, or POISON everywhere (``seed`` None)."""
    config = PlanarCacheConfig(block_size=BLOCK_SIZE, plane_block_bytes=PLANE_BYTES,
                               description=json.dumps({"engine": "offer-test"}))
    if seed is None:
        buffers = [torch.full((NUM_BLOCKS * n,), POISON, dtype=torch.uint8) for n in PLANE_BYTES]
    else:
        g = torch.Generator().manual_seed(seed)
        buffers = [torch.randint(0, 256, (NUM_BLOCKS * n,), dtype=torch.uint8, generator=g) for n in PLANE_BYTES]
    return PlanarPool(PlanarLayout(config), buffers, num_blocks=NUM_BLOCKS)


def block_bytes(pool: PlanarPool, block: int) -> list[torch.Tensor]:
    return [pool.block_plane(i)[block * n:(block + 1) * n] for i, n in enumerate(PLANE_BYTES)]


def grant_of(grant_id: str, request_id: str, block_ids: tuple[int, ...], prompt_len: int) -> PrefillGrant:
    """The grant as the engine's own protocol tells the decode engine about it (no Prefill call)."""
    return PrefillGrant(grant_id=grant_id, request_id=request_id, prompt_len=prompt_len, num_blocks=len(block_ids),
                        ring_live=RingRange(0, 0), first_token=0, lease_s=30.0, src_block_ids=block_ids, src_ring_id=0)


class OfferingPair:
    """A prefill connector on an engine's planes (its blocks lent by ``prefill_cache``) and decode
    connectors (``engine_ids``) on planes of their own, in this loop; ``ended`` lists the requests whose
    offered blocks went back to the prefill engine."""

    def __init__(self, *, lease_s: float = 30.0, engine_ids=("decode-a",)) -> None:
        config = ConnectorConfig(peer_token=TOKEN, lease_s=lease_s, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))
        self.prefill_cache = EngineCache(planes(seed=7))
        self.decode_caches = {e: EngineCache(planes(seed=None)) for e in engine_ids}
        self.prefill = PrefillConnector(self.prefill_cache.pool, NoPrefillCalls(), engine_id="prefill-o", config=config,
                                        registry=CollectorRegistry(), transports=(Transport.GRPC_STREAM,))
        self.decodes = {e: DecodeConnector(self.decode_caches[e].pool, engine_id=e, config=config,
                                           registry=CollectorRegistry(), transports=(Transport.GRPC_STREAM,))
                        for e in engine_ids}
        self.ended: list[str] = []

    async def __aenter__(self) -> "OfferingPair":
        self.server = await serve_prefill(self.prefill)
        address = f"127.0.0.1:{self.server.port}"
        self.peers = {}
        for engine_id, decode in self.decodes.items():
            await decode.start()
            self.peers[engine_id] = await decode.connect(address)
        return self

    async def __aexit__(self, *exc) -> None:
        for decode in self.decodes.values():
            await decode.close()
        await stop_prefill(self.server, self.prefill)

    def offer(self, request_id: str, block_ids: tuple[int, ...], prompt_len: int) -> PrefillGrant:
        allocation = self.prefill_cache.lend(request_id, block_ids, on_release=lambda: self.ended.append(request_id))
        grant_id = secrets.token_hex(16)
        self.prefill.offer(allocation, grant_id=grant_id, request_id=request_id, prompt_len=prompt_len)
        return grant_of(grant_id, request_id, block_ids, prompt_len)


def ended_as(pair: OfferingPair, expected: list[str]):
    """A check for ``until``: the offered blocks that went back are those of ``expected``."""
    async def check() -> bool:
        return pair.ended == expected
    return check


def test_the_first_engine_pulls_an_offered_grant_and_its_release_frees_the_engine_blocks():
    async def main():
        async with OfferingPair() as pair:
            src = (3, 4, 5, 9)  # two runs: one region per plane for each
            grant = pair.offer("req-1", src, prompt_len=3 * BLOCK_SIZE + 5)
            dst = (0, 1, 10, 11)
            decode = pair.decode_caches["decode-a"]
            with decode.lend("req-1", dst, on_release=lambda: None) as into:
                landed = await pair.peers["decode-a"].pull(grant, into=into, transport=Transport.GRPC_STREAM,
                                                           integrity=True)
            assert landed.nbytes == len(src) * sum(PLANE_BYTES)
            for s, d in zip(src, dst):
                assert all(torch.equal(a, b) for a, b in zip(block_bytes(decode.pool, d),
                                                             block_bytes(pair.prefill_cache.pool, s))), f"block {s}"
            untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
            assert all(bool((p == POISON).all()) for b in untouched for p in block_bytes(decode.pool, b))
            await until(ended_as(pair, ["req-1"]), "the offered blocks going back", 10.0)
            assert pair.prefill_cache.allocations_held == 0
    asyncio.run(main())


def test_a_grant_claimed_by_one_engine_is_refused_to_another():
    async def main():
        async with OfferingPair(engine_ids=("decode-a", "decode-b")) as pair:
            grant = pair.offer("req-2", (2, 3), prompt_len=2 * BLOCK_SIZE)
            assert await pair.peers["decode-b"].heartbeat([grant.grant_id]) == []  # B names it first: B's
            a_cache = pair.decode_caches["decode-a"]
            with a_cache.lend("req-2", (0, 1), on_release=lambda: None) as into:
                with pytest.raises(StatusError) as refused:
                    await pair.peers["decode-a"].pull(grant, into=into, transport=Transport.GRPC_STREAM)
            assert refused.value.code.name == "PERMISSION_DENIED"
            assert all(bool((p == POISON).all()) for p in a_cache.pool.planes)  # not a byte moved
            assert pair.ended == [] and pair.prefill_cache.allocations_held == 1  # still B's grant
            b_cache = pair.decode_caches["decode-b"]
            with b_cache.lend("req-2", (5, 6), on_release=lambda: None) as into:
                await pair.peers["decode-b"].pull(grant, into=into, transport=Transport.GRPC_STREAM)
            assert torch.equal(block_bytes(b_cache.pool, 6)[2], block_bytes(pair.prefill_cache.pool, 3)[2])
            await until(ended_as(pair, ["req-2"]), "the offered blocks going back", 10.0)
    asyncio.run(main())


def test_an_unclaimed_offer_frees_the_engine_blocks_when_its_lease_ends():
    async def main():
        async with OfferingPair(lease_s=0.5) as pair:
            pair.offer("req-3", (1,), prompt_len=4)
            assert pair.prefill_cache.allocations_held == 1
            await until(ended_as(pair, ["req-3"]), "the lease's end freeing the blocks", 15.0)
            assert pair.prefill_cache.allocations_held == 0
    asyncio.run(main())


@pytest.mark.parametrize("change, named", [
    ({"prompt_len": 0}, "prompt_len"),
    ({"grant_id": ""}, "ids"),
    ({"request_id": ""}, "ids"),
])
def test_a_bad_offer_holds_nothing_and_leaves_the_allocation_the_engine_s(change, named):
    async def main():
        async with OfferingPair() as pair:
            allocation = pair.prefill_cache.lend("req-4", (0, 1), on_release=lambda: pair.ended.append("req-4"))
            offer = {"grant_id": "g" * 32, "request_id": "req-4", "prompt_len": 20} | change
            with pytest.raises(ValueError, match=named):
                pair.prefill.offer(allocation, **offer)
            assert not allocation.released and pair.ended == []
            allocation.release()
            assert pair.ended == ["req-4"]
    asyncio.run(main())


def test_an_offer_under_a_grant_id_in_use_is_refused():
    async def main():
        async with OfferingPair() as pair:
            grant = pair.offer("req-5", (0,), prompt_len=8)
            second = pair.prefill_cache.lend("req-6", (1,), on_release=lambda: pair.ended.append("req-6"))
            with pytest.raises(ValueError, match="in use"):
                pair.prefill.offer(second, grant_id=grant.grant_id, request_id="req-6", prompt_len=8)
            assert not second.released and pair.prefill_cache.allocations_held == 2
            second.release()
    asyncio.run(main())
