"""A UCX pull from 128-token prefill blocks into 256-token decode blocks, both pools on cuda:0: the bytes land in
the peer's staging buffer as a same-layout pull's land in our blocks, and the repack is enqueued on the device
behind the landing, the host waiting for nothing (``LandedRequest.ready`` is its event). To show the order, the
repack is queued behind a long kernel on the same stream, with an event recorded between the two: the pull
returns while the long kernel still runs (so the host never waited for the stream between the landing and the
repack); a reader on another stream that does not wait, and whose read completed while the long kernel still ran
(so before the repack could start), sees the poison the blocks held; and one that waits on ``ready`` reads every
layer's states as the prefill node wrote them, the bytes the repack does not write still poison.

A reader that does not wait is not ordered before the repack either: CUDA may hold its work behind work already
queued (loading a kernel on its first launch, an allocation, the caching allocator freeing its cache) and the
host may stall, so its bytes are judged only by whether the long kernel still ran once the read completed, and
the read allocates nothing and launches only kernels it launched before the pull. Run by ``tests/gpu/run_all.sh``
on an H200 (needs ucxx):

    GPU_TESTS=tests/gpu/test_staged_repack_order_gpu.py SKIP_BENCH=1 SKIP_TRANSFER=1 SKIP_DCP=1 SKIP_DECODE=1 \
        SKIP_PREFILL=1 bash tests/gpu/run_all.sh
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kpool_pd import kernels
from kpool_pd.connector import Transport, ucx_available
from kpool_pd.kvcache import BlockLayout
from tests.support import connector_procs as procs
from tests.support.arrangements import arrangement_configs
from tests.support.connector_bytes import host_copy
from tests.support.connector_harness import InProcessPair
from tests.support.pulls import allocation_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ucx_available(), reason="needs ucxx"),
]

PAIR = "kpool2-128-to-256-two-pages"
LONG_KERNEL_CYCLES = 1 << 31  # about a second at an H100's or H200's clock: far longer than the rest of the pull
POISON = 0xAB
SHOWN = 8  # differing byte runs a message names


def where_in_block(layout: BlockLayout, offset: int) -> str:
    """Which layer's page (MLA, indexer, or the padding after them) holds byte ``offset`` of a block."""
    for page in reversed(layout.layers):
        if offset >= page.mla_offset:
            if offset < page.mla_offset + layout.mla_page_bytes:
                return f"layer {page.index} MLA +{offset - page.mla_offset}"
            if page.indexer_offset <= offset < page.indexer_offset + layout.indexer_page_bytes:
                return f"layer {page.index} indexer +{offset - page.indexer_offset}"
            return f"layer {page.index} padding"
    return "before the first layer"


def describe_bytes(layout: BlockLayout, block_ids, bad: torch.Tensor, got: torch.Tensor, repacked: torch.Tensor) -> str:
    """The byte runs where ``bad`` is set, block by block, each with where it lies and whether ``got`` holds the
    repack's bytes there (``repacked``, the blocks once the repack ran) or others.
    # bad: [n, block_bytes] bool; got, repacked: [n, block_bytes] uint8 (the rows of ``block_ids``)"""
    lines = []
    for row, block in enumerate(block_ids):
        offsets = bad[row].nonzero().flatten().tolist()
        if not offsets:
            continue
        runs, start = [], offsets[0]
        for prev, cur in zip(offsets, offsets[1:] + [None]):
            if cur != prev + 1:
                runs.append((start, prev + 1))
                start = cur
        same = int((got[row][bad[row]] == repacked[row][bad[row]]).sum())
        shown = ", ".join(f"[{a}, {b}) {where_in_block(layout, a)}" for a, b in runs[:SHOWN])
        lines.append(f"block {block}: {len(offsets)} bytes in {len(runs)} runs, {same} of them equal to the repack's "
                     f"bytes: {shown}{' ...' if len(runs) > SHOWN else ''}")
    return "; ".join(lines)


def repack_writes(real_repack, peer_layout: BlockLayout, layout: BlockLayout, src_blocks: int, dst_blocks: int,
                  n: int) -> torch.Tensor:
    """Which bytes of a request's first ``dst_blocks`` blocks the repack of ``n`` tokens writes, by the torch
    reference on the host (what it writes is checked against the prefill node's bytes separately).
    # -> [dst_blocks, block_bytes] bool"""
    src = torch.ones(src_blocks, peer_layout.block_bytes, dtype=torch.uint8)
    dst = torch.zeros(dst_blocks, layout.block_bytes, dtype=torch.uint8)
    real_repack(src, peer_layout, list(range(src_blocks)), dst, layout, list(range(dst_blocks)), n)
    return dst != 0


@pytest.mark.parametrize("n", [1, 129, 2 * 256 + 1], ids=["one-token", "129-tokens", "513-tokens"])
def test_repack_runs_behind_the_landing_and_its_reader_waits_on_the_device(monkeypatch, n):
    real_repack = kernels.repack_tokens
    long_kernel_ran: list[torch.cuda.Event] = []  # recorded behind the long kernel, before the repack's launches

    def behind_a_long_kernel(*args, **kwargs):
        torch.cuda._sleep(LONG_KERNEL_CYCLES)  # on the stream the repack is enqueued on, just before it
        event = torch.cuda.Event()
        event.record()
        long_kernel_ran.append(event)
        real_repack(*args, **kwargs)

    async def main():
        async with InProcessPair(transports=(Transport.UCX,), num_blocks=48, device="cuda:0",
                                 **arrangement_configs(PAIR)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            assert peer.repacks is True
            pool, layout = pair.decode.pool, pair.decode.pool.layout
            # a first pull of the same length (other tokens, another request's bytes) compiles the repack's kernels
            # (a compile behind the long kernel would outlast it) and leaves the staging buffer the next pull lands in
            warm = await peer.prefill(f"warm-{n}", [5] * n)
            warm_allocation = allocation_for(pair.d_cache, warm)
            await peer.pull(warm, into=warm_allocation, transport=Transport.UCX)
            torch.cuda.synchronize()
            warm_allocation.release()
            request_id = f"ordered-{n}"
            grant = await peer.prefill(request_id, [7] * n)
            allocation = allocation_for(pair.d_cache, grant)
            block_ids = allocation.block_ids
            writes = repack_writes(real_repack, peer.layout, layout, grant.num_blocks, len(block_ids), n)
            ids = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
            pool.blocks[ids] = POISON
            torch.cuda.synchronize()
            # the early reader's stream, buffers and kernels, made and run once before the pull: the read then
            # allocates nothing and loads no kernel while the repack is queued
            reader = torch.cuda.Stream(pool.device)
            early = torch.empty(len(block_ids), layout.block_bytes, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(reader):
                gathered = torch.empty(len(block_ids), layout.block_bytes, dtype=torch.uint8, device=pool.device)

            def read_early() -> None:
                with torch.cuda.stream(reader):
                    torch.index_select(pool.blocks, 0, ids, out=gathered)
                    early.copy_(gathered, non_blocking=True)
                reader.synchronize()

            read_early()
            assert bool((early == POISON).all()), "the poison did not land before the pull"
            monkeypatch.setattr(kernels, "repack_tokens", behind_a_long_kernel)
            landed = await peer.pull(grant, into=allocation, transport=Transport.UCX, release=False)
            assert landed.repacked is True
            (held,) = long_kernel_ran
            # the host is back while the long kernel, and so the repack, still waits: it never waited for the stream
            assert not held.query(), ("the pull returned after the long kernel ran: the host waited for the device "
                                      "(or stalled for as long as the kernel runs)")
            assert not landed.ready.done, "the pull returned after its repack ran: the host waited for the device"
            read_early()  # no wait on ``ready``
            read_while_held = not held.query()  # the read completed before the repack could start
            landed.ready.wait(reader)
            with torch.cuda.stream(reader):
                after = host_copy(pool)
            assert landed.ready.done
            repacked = after.blocks[list(block_ids)]
            early_bad = early != POISON
            assert read_while_held, (
                "the early read completed only after the long kernel ran, so it cannot show the order (the reader "
                f"was held up by the device or the host); its bytes other than the poison: "
                f"{describe_bytes(layout, block_ids, early_bad, early, repacked) or 'none'}")
            assert not bool(early_bad.any()), (
                "bytes reached the blocks before the repack could run (read while the long kernel held it): "
                + describe_bytes(layout, block_ids, early_bad, early, repacked))
            untouched = ~writes & (repacked != POISON)
            assert not bool(untouched.any()), (
                "bytes the repack does not write changed: " + describe_bytes(layout, block_ids, untouched, repacked,
                                                                              repacked))
            src = procs.mirror_pool(pair.prefill.pool.layout, request_id, grant.num_blocks)
            differences = procs.state_differences(after, block_ids, allocation.ring_id, src,
                                                  range(grant.num_blocks), 0, procs.live_slots(pool.config, n), n)
            assert differences == [], differences
            torch.cuda.synchronize()
            allocation.release()
            assert await peer.release(grant.grant_id) is True
            assert peer.staging.idle == 1 and peer.staging.made == 1  # both pulls landed in one kept buffer
            assert pair.free() == start

    asyncio.run(asyncio.wait_for(main(), 120))
