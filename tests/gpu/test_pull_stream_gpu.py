"""A pull and the CUDA stream the decode steps run on: with both pools on cuda:0 and a long kernel running on
the current stream (as a decode step runs in a decode daemon), a UCX pull returns while it still runs: a
same-layout pull with its bytes in place, a pull from another block size with its repack queued behind that
kernel (``LandedRequest.ready`` not done yet), the host waiting for neither. Run by ``tests/gpu/run_all.sh`` on
an H200 (needs ucxx)."""

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
def test_a_ucx_pull_returns_while_the_stream_is_busy_a_repack_queued_behind_it(arrangement):
    configs = {} if arrangement is None else arrangement_configs(arrangement)

    async def main():
        async with InProcessPair(transports=(Transport.UCX,), num_blocks=48, device="cuda:0", **configs) as pair:
            peer = await pair.decode.connect(pair.address)
            with await pull_into(pair.d_cache, peer, await peer.prefill("warm", [7] * PROMPT),
                                 transport=Transport.UCX):
                pass  # the repack's kernels compiled (a compile behind the busy kernel could outlast it)
            grant = await peer.prefill("busy-stream", [7] * PROMPT)
            torch.cuda.synchronize()  # the prefill node's bytes are written
            busy = _busy_stream()
            with await pull_into(pair.d_cache, peer, grant, transport=Transport.UCX) as landed:
                stream_still_busy, ready_at_return = not busy.query(), landed.ready.done
                torch.cuda.synchronize()
                src = procs.mirror_pool(pair.prefill.pool.layout, "busy-stream", grant.num_blocks)
                differences = procs.state_differences(host_copy(pair.decode.pool), landed.block_ids, landed.ring_id,
                                                      src, range(grant.num_blocks), 0,
                                                      procs.live_slots(pair.decode.pool.config, PROMPT), PROMPT)
            assert differences == []
            assert landed.repacked is (arrangement is not None)
            # neither pull waited for the stream; a repack runs on it, behind the long kernel, after the pull returned
            assert stream_still_busy is True
            assert ready_at_return is (arrangement is None)

    asyncio.run(asyncio.wait_for(main(), 120))
