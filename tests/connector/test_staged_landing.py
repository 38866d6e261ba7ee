"""A pull from a prefill node of another arrangement lands as a same-layout pull does, straight into memory
that is already there: the peer's staging buffers (``kpool_pd.connector.decode.staging``) are kept from one pull
to the next, a buffer is lent again only once the repack that read it has run, and each pull's repack places
the prompt's states into our blocks byte for byte as the prefill node holds them. On the CPU the repack runs in
the pull and its blocks are ready as it returns (``LandedRequest.ready``); the GPU suite checks the CUDA
ordering (tests/gpu/test_staged_repack_order_gpu.py). Byte-equality with the colocated run over these block-size
pairs is tests/e2e/test_e2e_heterogeneous.py's."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kpool_pd.connector import StatusError, Transport, ucx_available
from kpool_pd.connector.decode.inbound import Landing
from kpool_pd.connector.decode.staging import KEEP_IDLE, BlocksReady, RepackStaging
from kpool_pd.connector.shared import hops, regions  # regions: fault injection (how the gRPC stream reads bytes)
from kpool_pd.kvcache import BlockLayout
from tests.support import connector_procs as procs
from tests.support.arrangements import arrangement_configs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.pulls import allocation_for, pull_into

TRANSPORTS = [pytest.param(Transport.GRPC_STREAM, id="grpc"),
              pytest.param(Transport.UCX, id="ucx", marks=pytest.mark.skipif(not ucx_available(), reason="needs ucxx"))]
PAIR = "kpool2-128-to-256-two-pages"  # prefill blocks of 128 tokens, decode blocks of 256


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


class _Pending:
    """A repack still running on the device, as ``BlocksReady.done`` reports it."""
    done = False


# the buffers ---------------------------------------------------------------------------------
def test_a_kept_buffer_is_lent_again_only_once_its_repack_ran():
    buffers = RepackStaging(BlockLayout(procs.make_config("kpool2")), "cpu", keep_idle=2)
    first = buffers.take(3)
    assert first.blocks.shape == (3, buffers.peer_layout.block_bytes) and first.ids.tolist() == [0, 1, 2]
    buffers.give_back(first, _Pending())
    second = buffers.take(2)  # the kept one is still read by its repack: a new buffer
    assert second.blocks.data_ptr() != first.blocks.data_ptr() and buffers.made == 2
    buffers.give_back(second, BlocksReady.NOW)
    third = buffers.take(2)  # the second one, whose repack ran
    assert third.blocks.data_ptr() == second.blocks.data_ptr() and buffers.made == 2
    assert third.ids.tolist() == [0, 1]
    bigger = buffers.take(5)  # none kept holds 5 blocks: 8 made (a power of two), then lent for 7 as well
    buffers.give_back(bigger, BlocksReady.NOW)
    assert buffers.take(7).blocks.data_ptr() == bigger.blocks.data_ptr() and buffers.made == 3


def test_at_most_keep_idle_buffers_are_kept_and_never_one_still_read():
    buffers = RepackStaging(BlockLayout(procs.make_config("kpool2")), "cpu", keep_idle=1)
    lent = [buffers.take(n) for n in (1, 2, 4)]
    buffers.give_back(lent[0], _Pending())
    buffers.give_back(lent[1], _Pending())
    assert buffers.idle == 2  # over the limit, but both may still be read: kept until their repacks ran
    buffers.give_back(lent[2], BlocksReady.NOW)
    assert buffers.idle == 2  # the done one goes, the read ones stay
    with pytest.raises(ValueError, match="at least 1 block, got 0"):
        buffers.take(0)
    with pytest.raises(ValueError, match="keep_idle must be >= 0, got -1"):
        RepackStaging(buffers.peer_layout, "cpu", keep_idle=-1)


# pulls ---------------------------------------------------------------------------------------
def _differences(pair: InProcessPair, landed, request_id: str, n: int) -> list[str]:
    src = procs.mirror_pool(pair.prefill.pool.layout, request_id, landed.grant.num_blocks)
    return procs.state_differences(pair.decode.pool, landed.block_ids, landed.ring_id, src,
                                   range(landed.grant.num_blocks), 0, procs.live_slots(pair.decode.pool.config, n), n)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_staged_pulls_land_in_the_peers_kept_buffer(transport):
    async def main():
        async with InProcessPair(transports=(transport,), num_blocks=48, **arrangement_configs(PAIR)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            assert peer.repacks is True and peer.staging.made == 0
            # the longest first: the shorter ones land in its buffer, over what it left there
            for i, n in enumerate([3 * 256 + 5, 1, 129, 256, 2 * 256 + 1]):
                request_id = f"kept-{i}"
                grant = await peer.prefill(request_id, [7] * n)
                with await pull_into(pair.d_cache, peer, grant, transport=transport) as landed:
                    assert landed.repacked is True and landed.ready.done
                    assert _differences(pair, landed, request_id, n) == [], n
                assert (peer.staging.made, peer.staging.idle) == (1, 1), (n, peer.staging)
            assert pair.free() == start
    run(main())


def test_staged_pulls_at_once_each_land_in_a_buffer_of_their_own():
    async def main():
        async with InProcessPair(transports=(Transport.GRPC_STREAM,), num_blocks=48,
                                 **arrangement_configs(PAIR)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            lengths = [300, 200, 513]
            grants = [await peer.prefill(f"together-{i}", [5] * n) for i, n in enumerate(lengths)]
            pulled = await asyncio.gather(*(pull_into(pair.d_cache, peer, g, transport=Transport.GRPC_STREAM)
                                            for g in grants))
            for i, (landed, n) in enumerate(zip(pulled, lengths)):
                assert _differences(pair, landed, f"together-{i}", n) == [], n
                landed.release()
            assert peer.staging.made == 3 and peer.staging.idle == KEEP_IDLE
            assert pair.free() == start
    run(main())


def test_a_failed_staged_pull_gives_its_buffer_back_and_the_next_lands_whole(monkeypatch):
    real = regions.host_bytes
    corrupt = {"on": True}

    def flip_one_byte(view):
        data = bytearray(real(view))
        if corrupt["on"]:
            data[0] ^= 1
        return bytes(data)
    monkeypatch.setattr(regions, "host_bytes", flip_one_byte)

    async def main():
        async with InProcessPair(num_blocks=48, **arrangement_configs(PAIR)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("corrupt", [1] * 300)
            allocation = allocation_for(pair.d_cache, grant)
            with pytest.raises(StatusError, match="crc32 mismatch"):
                await peer.pull(grant, into=allocation, transport=Transport.GRPC_STREAM, integrity=True)
            allocation.release()
            assert await peer.release(grant.grant_id) is True
            assert (peer.staging.made, peer.staging.idle) == (1, 1)
            corrupt["on"] = False
            grant = await peer.prefill("whole", [1] * 300)
            with await pull_into(pair.d_cache, peer, grant, transport=Transport.GRPC_STREAM, integrity=True) as landed:
                assert _differences(pair, landed, "whole", 300) == []
            assert (peer.staging.made, peer.staging.idle) == (1, 1)
            assert pair.free() == start
    run(main())


@pytest.mark.skipif(not ucx_available(), reason="needs ucxx")
def test_the_request_is_written_before_the_repack_table_is_made(monkeypatch):
    """The staged pull's request leaves first (the session's writer hands it to gRPC: hop ``written``); the
    repack's block table is made after it, while the bytes travel, not between the request and its write."""
    made_at: list[float] = []
    real = Landing.prepare

    def noting(landing):
        if landing.staging is not None and not made_at:
            made_at.append(time.perf_counter())
        real(landing)
    monkeypatch.setattr(Landing, "prepare", noting)
    recorder = hops.HopRecorder().install()

    async def main():
        async with InProcessPair(transports=(Transport.UCX,), num_blocks=48, **arrangement_configs(PAIR)) as pair:
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("written-first", [2] * 700)
            with await pull_into(pair.d_cache, peer, grant, transport=Transport.UCX) as landed:
                assert _differences(pair, landed, "written-first", 700) == []
            return grant.grant_id
    try:
        grant_id = run(main())
    finally:
        recorder.uninstall()
    stamps = recorder.stamps[grant_id]
    assert made_at and stamps["request"] <= stamps["written"] <= made_at[0], (stamps, made_at)


def test_blocks_ready_on_the_cpu_is_ready_at_once():
    ready = BlocksReady.behind_current_work(torch.device("cpu"))
    assert ready is BlocksReady.NOW and ready.done
    ready.wait()  # nothing to wait for
    ready.synchronize()
