"""A pull and the CUDA stream the decode steps run on: with both pools on cuda:0 and a long kernel running on
the current stream (as a decode step runs in a decode daemon), a same-layout UCX pull returns while it still
runs, its bytes in place; a pull from another block size returns once its repack, queued behind that kernel,
has run. Run by ``tests/gpu/run_all.sh`` on an H200 (needs ucxx)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kpool_pd.connector import Transport, ucx_available
from tests.support import connector_procs as procs
from tests.support.arrangements import arrangement_configs
from tests.support.connector_bytes import host_copy
from tests.support.connector_harness import InProcessPair
from tests.support.pulls import pull_into

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ucx_available(), reason="needs ucxx"),
]

BUSY_CYCLES = 1_500_000_000  # GPU clock cycles of the stand-in decode step: 0.75 s at 2 GHz, within the pull's 5 s
PROMPT = 300


def _busy_stream() -> torch.cuda.Event:
    """Queue a kernel that spins for BUSY_CYCLES on the current stream; the event completes when it ends."""
    torch.cuda._sleep(BUSY_CYCLES)
    done = torch.cuda.Event()
    done.record()
    return done


@pytest.mark.parametrize("arrangement", [None, "kpool-32-to-64"], ids=["same-layout", "from-32-blocks"])
def test_a_ucx_pull_waits_for_the_stream_only_when_it_repacks(arrangement):
    configs = {} if arrangement is None else arrangement_configs(arrangement)

    async def main():
        async with InProcessPair(transports=(Transport.UCX,), num_blocks=48, device="cuda:0", **configs) as pair:
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("busy-stream", [7] * PROMPT)
            torch.cuda.synchronize()  # the prefill node's bytes are written
            busy = _busy_stream()
            with await pull_into(pair.d_cache, peer, grant, transport=Transport.UCX) as landed:
                stream_still_busy = not busy.query()
                torch.cuda.synchronize()
                src = procs.mirror_pool(pair.prefill.pool.layout, "busy-stream", grant.num_blocks)
                differences = procs.state_differences(host_copy(pair.decode.pool), landed.block_ids, landed.ring_id,
                                                      src, range(grant.num_blocks), 0,
                                                      procs.live_slots(pair.decode.pool.config, PROMPT), PROMPT)
            assert differences == []
            assert landed.repacked is (arrangement is not None)
            # a repack runs on the stream, behind the long kernel; a same-layout pull leaves the stream alone
            assert stream_still_busy is (arrangement is None)

    asyncio.run(asyncio.wait_for(main(), 120))
