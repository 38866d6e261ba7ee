"""A pull between layouts that arrange the same cache otherwise (block size, order), with both pools on
cuda:0: the blocks land in a staging buffer on the GPU and the Triton repack places them, its block
tables made while the request travels (``Landing.prepare``); every layer's rows of the prompt's
positions and the ring's live rows then read as the prefill node wrote them. Run by
``tests/gpu/run_all.sh`` on an H200 (both transports; the UCX one needs ucxx)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kpool_pd.connector import Transport, ucx_available
from tests.support import connector_procs as procs
from tests.support.arrangements import ARRANGEMENTS, arrangement_configs
from tests.support.connector_bytes import host_copy
from tests.support.connector_harness import InProcessPair
from tests.support.pulls import pull_into

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TRANSPORTS = [pytest.param(Transport.GRPC_STREAM, id="grpc"),
              pytest.param(Transport.UCX, id="ucx",
                           marks=pytest.mark.skipif(not ucx_available(), reason="needs ucxx"))]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", ["kpool-32-to-64", "kpool-128-to-32-blhnc", "kpool2-128-to-256-two-pages",
                                  "qsa-64-to-16-blhnc"])
def test_pull_between_arrangements_on_cuda(name, transport):
    _, prefill_side, decode_side = ARRANGEMENTS[name]

    async def main():
        async with InProcessPair(transports=(transport,), num_blocks=48, device="cuda:0",
                                 **arrangement_configs(name)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            assert peer.repacks is True
            small, large = sorted((prefill_side[1], decode_side[1]))
            for i, n in enumerate([1, small + 1, large + 5, 2 * large + 3]):
                request_id = f"{name}-cuda-{i}"
                grant = await peer.prefill(request_id, [7] * n)
                with await pull_into(pair.d_cache, peer, grant, transport=transport) as landed:
                    assert landed.repacked is True
                    src = procs.mirror_pool(pair.prefill.pool.layout, request_id, grant.num_blocks)
                    differences = procs.state_differences(host_copy(pair.decode.pool), landed.block_ids, landed.ring_id,
                                                          src, range(grant.num_blocks), 0,
                                                          procs.live_slots(pair.decode.pool.config, n), n)
                    assert differences == [], (n, differences)
            assert pair.free() == start

    asyncio.run(asyncio.wait_for(main(), 120))
