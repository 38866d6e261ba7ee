"""A UCX pull from 128-token prefill blocks into 256-token decode blocks, both pools on cuda:0: the bytes land in
the peer's staging buffer as a same-layout pull's land in our blocks, and the repack is enqueued on the device
behind the landing, the host waiting for nothing (``LandedRequest.ready`` is its event). To show the order, the
repack is queued behind a long kernel on the same stream: the pull returns while the repack has not run (so the
host never waited for the stream between the landing and the repack), a reader on another stream that does not
wait still sees the poison the blocks held, and one that waits on ``ready`` reads every layer's states as the
prefill node wrote them. Run by ``tests/gpu/run_all.sh`` on an H200 (needs ucxx):

    GPU_TESTS=tests/gpu/test_staged_repack_order_gpu.py SKIP_BENCH=1 SKIP_TRANSFER=1 SKIP_DCP=1 SKIP_DECODE=1 \
        SKIP_PREFILL=1 bash tests/gpu/run_all.sh
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kpool_pd import kernels
from kpool_pd.connector import Transport, ucx_available
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
LONG_KERNEL_CYCLES = 1 << 31  # about a second at an H200's clock: far longer than the rest of the pull
POISON = 0xAB


@pytest.mark.parametrize("n", [1, 129, 2 * 256 + 1], ids=["one-token", "129-tokens", "513-tokens"])
def test_repack_runs_behind_the_landing_and_its_reader_waits_on_the_device(monkeypatch, n):
    real_repack = kernels.repack_tokens

    def behind_a_long_kernel(*args, **kwargs):
        torch.cuda._sleep(LONG_KERNEL_CYCLES)  # on the stream the repack is enqueued on, just before it
        real_repack(*args, **kwargs)

    async def main():
        async with InProcessPair(transports=(Transport.UCX,), num_blocks=48, device="cuda:0",
                                 **arrangement_configs(PAIR)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            assert peer.repacks is True
            # a first pull of the same length compiles the repack's kernels (a compile behind the long kernel
            # would outlast it) and leaves the peer's staging buffer the measured pull lands in
            warm = await peer.prefill(f"warm-{n}", [7] * n)
            warm_allocation = allocation_for(pair.d_cache, warm)
            await peer.pull(warm, into=warm_allocation, transport=Transport.UCX)
            torch.cuda.synchronize()
            warm_allocation.release()
            monkeypatch.setattr(kernels, "repack_tokens", behind_a_long_kernel)
            request_id = f"ordered-{n}"
            grant = await peer.prefill(request_id, [7] * n)
            allocation = allocation_for(pair.d_cache, grant)
            pool = pair.decode.pool
            ids = torch.tensor(allocation.block_ids, dtype=torch.int64, device=pool.device)
            pool.blocks[ids] = POISON
            torch.cuda.synchronize()
            landed = await peer.pull(grant, into=allocation, transport=Transport.UCX, release=False)
            assert landed.repacked is True
            # the host is back while the repack still waits behind the long kernel: it never waited for the stream
            assert not landed.ready.done, "the pull returned after its repack ran: the host waited for the device"
            reader = torch.cuda.Stream(pool.device)
            with torch.cuda.stream(reader):
                early = pool.blocks[ids].cpu()  # no wait on ``ready``: the repack has not written yet
            landed.ready.wait(reader)
            with torch.cuda.stream(reader):
                after = host_copy(pool)
            assert landed.ready.done
            assert bool((early == POISON).all()), "a reader that did not wait saw the repack's bytes already"
            src = procs.mirror_pool(pair.prefill.pool.layout, request_id, grant.num_blocks)
            differences = procs.state_differences(after, allocation.block_ids, allocation.ring_id, src,
                                                  range(grant.num_blocks), 0, procs.live_slots(pool.config, n), n)
            assert differences == [], differences
            torch.cuda.synchronize()
            allocation.release()
            assert await peer.release(grant.grant_id) is True
            assert peer.staging.idle == 1 and peer.staging.made == 1  # both pulls landed in one kept buffer
            assert pair.free() == start

    asyncio.run(asyncio.wait_for(main(), 120))
