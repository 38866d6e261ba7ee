"""A prefill node (no DCP) serves a DCP decode instance: one plan per rank, each rank pulling its own
tokens and pools plus the whole ring, leases and releases per rank; over both transports.

The prefill node's blocks hold seeded bytes (every byte differs), so each rank's landed bytes are
compared with the share ``kpool_pd.model.dcp_landing`` copies in one process; and the bytes each rank
receives add up to the request's blocks (DCP adds no byte but each rank's copy of the ring)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, RankShare, StatusError, Transport
from kpool_pd.connector.shared.dcp_plan import plan_dcp_transfer
from kpool_pd.connector.shared.plan import plan_transfer, ring_live_range
from kpool_pd.kvcache import BlockLayout, CachePool, DcpShard, NodeCache
from kpool_pd.connector.shared.regions import region_view
from kpool_pd.model import ModelConfig
from kpool_pd.model.dcp_landing import land_request
from tests.support import connector_procs as procs
from tests.support.connector_bytes import expected_ring
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.pulls import pull_into

GRPC = Transport.GRPC_STREAM
CONFIG = procs.CONFIG  # block 64, kpool 4, 3 layers


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(90)))


def _rank_node(rank: int, transport: Transport) -> tuple[NodeCache, DecodeConnector]:
    """Another rank of the pair's decode instance: its node cache and its connector."""
    config = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))
    cache = NodeCache(CONFIG, num_blocks=32, num_rings=4)
    return cache, DecodeConnector(cache.pool, engine_id=f"decode-t/dcp{rank}", config=config,
                                  registry=CollectorRegistry(), transports=(transport,))


def _share_equal(expected: CachePool, got: CachePool, blocks: tuple[int, ...], ring: int, shard: DcpShard,
                 prompt_len: int) -> None:
    """The rank's tokens' MLA bytes, its complete pools' entries and the ring's live slots agree."""
    config = got.config
    block, kpool, states = config.block_size, config.tokens_per_entry, config.family_spec.entries_per_block
    table = torch.tensor(blocks, dtype=torch.int64)
    local = torch.arange(shard.owned_tokens(prompt_len))
    pools = torch.arange(shard.owned_tokens(prompt_len // kpool * kpool) // kpool)
    for layer in range(config.num_layers):
        at = (table[local // block], local % block)
        assert torch.equal(got.mla(layer)[at], expected.mla(layer)[at]), f"MLA bytes, layer {layer}"
        for view in ("indexer_q", "indexer_scale"):
            mine, theirs = getattr(got, view)(layer), getattr(expected, view)(layer)
            per_page = mine.shape[2]  # [blocks, pages, states per page, ...]
            at = (table[pools // states], pools % states // per_page, pools % states % per_page)
            assert torch.equal(mine[at].view(torch.uint8), theirs[at].view(torch.uint8)), f"{view}, layer {layer}"
    live = ring_live_range(config, prompt_len)
    ring_size = config.tail_ring.ring_size
    slots = [(live.start_slot + i) % ring_size for i in range(live.num_slots)]
    rows = got.rings.view(got.num_rings, ring_size, -1)
    want = expected.rings.view(expected.num_rings, ring_size, -1)
    assert torch.equal(rows[ring, slots], want[ring, slots]), "ring live slots"


@pytest.mark.parametrize("page_states", [64, 32], ids=["two-pages", "four-pages"])
@pytest.mark.parametrize("ranks,interleave,prompt_len", [(2, 256, 700), (2, 40, 300), (3, 126, 555), (2, 2, 131)],
                         ids=["blocks", "runs-across-pages", "runs-across-blocks", "pool-by-pool"])
def test_a_rank_plan_moves_entries_across_kernel_pages(page_states, ranks, interleave, prompt_len):
    """kpool 2 in 256-token blocks (128 states: pages of 64 or 32): every rank's plan, applied byte by
    byte, lands what the in-process landing copies; runs of entries split where they cross a page."""
    config = ModelConfig.build(kpool=2, num_spec=3, num_layers=2, block_size=256, kernel_page_states=page_states).cache
    layout = BlockLayout(config)
    gen = torch.Generator().manual_seed(prompt_len)
    source = CachePool(layout, num_blocks=8, num_rings=2)
    source.blocks.copy_(torch.randint(0, 256, source.blocks.shape, dtype=torch.uint8, generator=gen))
    source.rings.copy_(torch.randint(0, 256, source.rings.shape, dtype=torch.uint8, generator=gen))
    src_blocks = [7, 2, 5][: config.blocks_for_tokens(prompt_len)]
    live = ring_live_range(config, prompt_len)
    for rank in range(ranks):
        shard = DcpShard(size=ranks, rank=rank, interleave=interleave)
        dst_blocks = list(range(shard.blocks_for_tokens(config, prompt_len)))
        got, expected = CachePool(layout, num_blocks=8, num_rings=2), CachePool(layout, num_blocks=8, num_rings=2)
        plan = plan_dcp_transfer(layout, src_blocks, dst_blocks, 0, 1, live, shard, prompt_len)
        for pair in plan.pairs:
            region_view(got, pair.dst).copy_(region_view(source, pair.src))
        land_request(source, src_blocks, 0, expected, dst_blocks, 1, shard, prompt_len)
        _share_equal(expected, got, tuple(dst_blocks), 1, shard, prompt_len)


@pytest.mark.parametrize("transport", [GRPC, Transport.UCX], ids=["grpc", "ucx"])
@pytest.mark.parametrize("ranks,interleave,prompt_len", [(2, 64, 200), (4, 64, 257), (2, 128, 129), (3, 8, 150),
                                                          (2, 12, 64), (4, 64, 3)],
                         ids=["dcp2-block", "dcp4-block", "dcp2-two-blocks", "dcp3-two-pools", "dcp2-three-pools",
                              "dcp4-short"])
def test_each_rank_pulls_its_own_share_and_the_ring(transport, ranks, interleave, prompt_len):
    async def main():
        async with InProcessPair(transports=(transport,)) as pair:
            start = pair.free()[:2]
            nodes = [(pair.d_cache, pair.decode)] + [_rank_node(r, transport) for r in range(1, ranks)]
            caches, connectors = [cache for cache, _ in nodes], [connector for _, connector in nodes]
            pair.decode.engine_id = "decode-t/dcp0"
            for c in connectors[1:]:
                await c.start()
            try:
                peers = [await c.connect(pair.address) for c in connectors]
                grant = await peers[0].prefill("dcp", [5] * prompt_len, dcp_engine_ids=[c.engine_id for c in connectors],
                                               dcp_interleave=interleave)
                shards = [DcpShard(size=ranks, rank=r, interleave=interleave) for r in range(ranks)]
                landed = await asyncio.gather(*(pull_into(cache, p, grant, transport=transport, dcp=s, integrity=True)
                                                for cache, p, s in zip(caches, peers, shards)))
                assert pair.free()[:2] == start, "the grant is freed once every rank released its share"
                source = CachePool(BlockLayout(CONFIG), num_blocks=len(grant.src_block_ids), num_rings=1)
                for j in range(len(grant.src_block_ids)):
                    source.blocks[j] = procs.expected_block(source.layout, "dcp", j)
                source.rings[0] = expected_ring(source.layout, "dcp")
                for c, got, shard in zip(connectors, landed, shards):
                    expected = CachePool(BlockLayout(CONFIG), num_blocks=c.pool.num_blocks, num_rings=c.pool.num_rings)
                    land_request(source, list(range(len(grant.src_block_ids))), 0, expected, list(got.block_ids),
                                 got.ring_id, shard, prompt_len)
                    _share_equal(expected, c.pool, got.block_ids, got.ring_id, shard, prompt_len)
                whole = plan_transfer(pair.prefill.pool.layout, list(grant.src_block_ids), list(grant.src_block_ids),
                                      0, 0, grant.ring_live)
                ring = sum(p.src.nbytes for p in whole.pairs[-2:] if p.src.kind.name == "RINGS")
                if interleave % CONFIG.block_size == 0:  # whole blocks: exactly the request's blocks, plus N rings
                    assert sum(g.nbytes for g in landed) == whole.total_bytes + (ranks - 1) * ring
                else:  # runs inside blocks: only the prompt's own bytes, never more than its blocks
                    assert sum(g.nbytes for g in landed) - (ranks - 1) * ring <= whole.total_bytes
                for got in landed:
                    got.release()
                assert [(c.free_blocks, c.free_rings) for c in caches] == [(32, 4)] * ranks
            finally:
                for c in connectors[1:]:
                    await c.close()
    run(main())


def test_a_rank_pull_under_another_rank_or_out_of_the_group_is_denied():
    async def main():
        async with InProcessPair() as pair:
            other_cache, other = _rank_node(1, GRPC)
            stranger_cache, stranger = _rank_node(5, GRPC)
            stranger.engine_id = "someone-else"
            await other.start()
            await stranger.start()
            try:
                peer0, peer1, peer_x = [await c.connect(pair.address) for c in (pair.decode, other, stranger)]
                grant = await peer0.prefill("dcp", [5] * 100, dcp_engine_ids=[pair.decode.engine_id, other.engine_id],
                                            dcp_interleave=64)
                for cache, peer, rank in ((other_cache, peer1, 0), (stranger_cache, peer_x, 1)):
                    with pytest.raises(StatusError) as err:
                        await pull_into(cache, peer, grant, transport=GRPC,
                                        dcp=DcpShard(size=2, rank=rank, interleave=64))
                    assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
                    assert (cache.free_blocks, cache.free_rings) == (32, 4)
                with pytest.raises(StatusError) as err:  # only rank 0 may release every rank's share
                    await peer1.release(grant.grant_id, dcp_rank=1, all_ranks=True)
                assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
                assert await peer1.release(grant.grant_id, dcp_rank=1)
                assert pair.prefill.grants_held == 1, "rank 0's share is still held"
                assert await peer0.release(grant.grant_id, all_ranks=True)
                pair.prefill.reap()
                assert pair.prefill.grants_held == 0 and pair.free()[:2] == (32, 4)
            finally:
                await other.close()
                await stranger.close()
    run(main())


def test_a_rank_allocation_short_of_its_share_is_refused_before_anything_is_sent():
    async def main():
        async with InProcessPair() as pair:
            other_cache, other = _rank_node(1, GRPC)
            await other.start()
            try:
                peer0, peer1 = [await c.connect(pair.address) for c in (pair.decode, other)]
                grant = await peer0.prefill("dcp", [5] * 300, dcp_engine_ids=[pair.decode.engine_id, other.engine_id],
                                            dcp_interleave=64)
                shard = DcpShard(size=2, rank=1, interleave=64)
                share = shard.blocks_for_tokens(other_cache.config, grant.prompt_len)  # 2 of the prompt's 5 blocks
                assert share == 2 < grant.num_blocks
                with other_cache.allocate("dcp", share - 1) as short:
                    with pytest.raises(ValueError, match=f"at least {share} blocks, got CacheAllocation"):
                        await peer1.pull(grant, into=short, transport=GRPC, share=RankShare(shard))
                    assert not short.released
                assert pair.prefill.grants_held == 1  # rank 1's share is still to pull
                with await pull_into(other_cache, peer1, grant, transport=GRPC, dcp=shard, integrity=True) as landed:
                    assert landed.prompt_blocks == share and landed.nbytes > 0
                assert (other_cache.free_blocks, other_cache.free_rings) == (32, 4)
                assert await peer0.release(grant.grant_id, all_ranks=True)
                pair.prefill.reap()
                assert pair.prefill.grants_held == 0 and pair.free() == (32, 4, 32, 4)
            finally:
                await other.close()
    run(main())


@pytest.mark.parametrize("ids,interleave,match", [
    (["decode-t", "r1"], 6, "multiple of kpool"),
    (["r0", "r1"], 64, "rank 0 being engine_id"),
    (["decode-t", "decode-t"], 64, "distinct"),
], ids=["interleave-off-the-pool", "rank0-not-the-asker", "twice"])
def test_a_malformed_dcp_prefill_is_refused_and_holds_nothing(ids, interleave, match):
    async def main():
        async with InProcessPair() as pair:
            peer = await pair.decode.connect(pair.address)
            with pytest.raises(StatusError, match=match) as err:
                await peer.prefill("dcp", [5] * 10, dcp_engine_ids=ids, dcp_interleave=interleave)
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert pair.free()[:2] == (32, 4) and pair.prefill.grants_held == 0
    run(main())


def test_a_dcp_plan_refuses_the_wrong_number_of_rank_blocks():
    layout = BlockLayout(CONFIG)
    shard = DcpShard(size=2, rank=1, interleave=64)
    with pytest.raises(ValueError, match=r"rank 1 of 2 lands a 200-token prompt in 2 blocks, got 1"):
        plan_dcp_transfer(layout, [0, 1, 2, 3], [7], 0, 0, ring_live_range(CONFIG, 200), shard, 200)


@pytest.mark.parametrize("ranks,tokens", [(2, 32768), (4, 32768), (2, 32769), (3, 1000)])
def test_dcp_adds_no_byte_but_a_ring_per_rank(ranks, tokens):
    """What ``kpool-pd bench dcp`` reports: at the default interleave (the block size) the ranks'
    plans move the single-rank plan's bytes, plus the ring once more for each rank beyond the first."""
    from kpool_pd.bench.dcp import transfer_bytes
    from kpool_pd.model import ModelConfig

    config = ModelConfig.build(kpool=4, num_spec=3, num_layers=4, block_size=256)
    single = transfer_bytes(config, 1, tokens)[0]
    layout = BlockLayout(config.cache)
    ring = ring_live_range(config.cache, tokens).num_slots * layout.ring_slot_bytes
    per_rank = transfer_bytes(config, ranks, tokens)
    assert sum(per_rank) == single + (ranks - 1) * ring
    assert max(per_rank) - ring <= -(-(single - ring) // layout.block_bytes // ranks) * layout.block_bytes


class _FailingRanks:
    """Ranks 1..N-1 whose Land fails (a rank died while pulling); Drops are recorded."""

    broken = ""

    def __init__(self) -> None:
        self.dropped: list[str] = []

    async def land(self, request_id, *args, **kwargs):
        await asyncio.sleep(0.05)
        raise StatusError(grpc.StatusCode.UNAVAILABLE, "DCP rank 1: Socket closed")

    def drop_soon(self, request_id: str = "") -> None:
        self.dropped.append(request_id)


def test_a_rank_failing_its_pull_gives_back_the_other_ranks_and_the_whole_grant_and_leaves_rank_0s_allocation():
    from kpool_pd.decode_worker.dcp_fetch import DcpLeader
    from kpool_pd.decode_worker.fetch import PullChoice
    from kpool_pd.decode_worker.jobs import Job
    from kpool_pd.kvcache import DcpConfig

    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            ranks = _FailingRanks()
            pulls = PullChoice(transport=GRPC, integrity=False, rpc_timeout_s=pair.decode.config.rpc_timeout_s)
            leader = DcpLeader(pair.d_cache.config, pulls, DcpConfig(size=2, interleave=64), ranks,
                               pair.decode.engine_id)
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("dcp", [5] * 150, dcp_engine_ids=leader.engine_ids, dcp_interleave=64)
            assert pair.prefill.grants_held == 1
            allocation = pair.d_cache.allocate("dcp", 4)  # rank 0's, as its scheduler admitted the request
            job = Job(request_id="dcp", prompt=(5,) * 150, max_tokens=10, need_blocks=4, allocation=allocation)
            with pytest.raises(StatusError, match="DCP rank 1") as err:
                await leader.pull(job, peer, grant)
            assert err.value.code is grpc.StatusCode.UNAVAILABLE
            assert ranks.dropped == ["dcp"], "the other ranks are told to free the request"
            assert not allocation.released, "rank 0's allocation stays its scheduler's to release"
            assert pair.free()[2:] == (start[2] - 4, start[3] - 1)
            allocation.release()
            for _ in range(100):  # the all-ranks Release runs in the background
                pair.prefill.reap()
                if pair.prefill.grants_held == 0:
                    break
                await asyncio.sleep(0.02)
            assert pair.prefill.grants_held == 0 and pair.free() == start, "every block back, on both nodes"
    run(main())


class _StuckRanks:
    """Ranks 1..N-1 stuck in a step's collective (waiting for a rank that died) until the instance breaks."""

    def __init__(self) -> None:
        self.broken = ""
        self._event = asyncio.Event()
        self.step_cancelled = False

    def fail(self, why: str) -> None:
        self.broken = why
        self._event.set()

    async def until_broken(self) -> str:
        await self._event.wait()
        return self.broken

    async def step(self, request_ids) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.step_cancelled = True
            raise


def test_a_step_waiting_on_a_dead_rank_fails_as_soon_as_the_instance_breaks():
    import threading
    import time

    from kpool_pd.decode_worker.dcp_fetch import DcpLeader
    from kpool_pd.decode_worker.fetch import PullChoice
    from kpool_pd.kvcache import DcpConfig

    def _leader(ranks) -> DcpLeader:
        pulls = PullChoice(transport=GRPC, integrity=False, rpc_timeout_s=5.0)
        return DcpLeader(ModelConfig.build(num_layers=2, kpool=4).cache, pulls, DcpConfig(size=3, interleave=64),
                         ranks, "decode")

    async def main():
        ranks = _StuckRanks()
        leader = _leader(ranks)
        released = threading.Event()  # rank 0's own part: a thread inside the collective
        own = asyncio.to_thread(released.wait, 30)
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, ranks.fail, "DCP rank 1 exited with status -9")
        started = time.monotonic()
        try:
            with pytest.raises(StatusError, match="the DCP decode instance is broken: DCP rank 1 exited") as err:
                await leader.step(own, ["a", "b"])
        finally:
            released.set()
        assert err.value.code is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5, "the step waited for the collective instead of the break"
        await asyncio.sleep(0)
        assert ranks.step_cancelled, "the other ranks' calls are cancelled"
        # a step that ends normally still returns rank 0's own result
        healthy = _StuckRanks()

        async def others(request_ids):
            return None
        healthy.step = others
        assert await _leader(healthy).step(asyncio.sleep(0, "mine"), ["a"]) == "mine"
    run(main())
