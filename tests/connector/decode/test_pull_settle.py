"""Which pulls wait for the current CUDA stream before they return (``regions.settle``): those that wrote through
it (the gRPC stream's chunks), not a UCX pull, whose bytes UCX lands itself (in a decode daemon the stream also
runs the decode steps): a UCX pull from another arrangement enqueues its repack on the stream and returns its
event (``LandedRequest.ready``) instead. On the CPU the waits are recorded, not made;
``tests/gpu/test_pull_stream_gpu.py`` and ``tests/gpu/test_staged_repack_order_gpu.py`` check them on a GPU."""

from __future__ import annotations

import asyncio

import pytest

from kpool_pd.connector import Transport, ucx_available
from kpool_pd.connector.decode import inbound
from tests.support.connector_harness import InProcessPair
from tests.support.pulls import pull_into
from tests.support.arrangements import arrangement_configs

@pytest.mark.parametrize(("transport", "arrangement", "settles"), [
    (Transport.UCX, None, False),
    (Transport.GRPC_STREAM, None, True),
    (Transport.UCX, "kpool-32-to-64", False),
    (Transport.GRPC_STREAM, "kpool-32-to-64", True),
], ids=["ucx-same-layout", "grpc-same-layout", "ucx-from-32-blocks", "grpc-from-32-blocks"])
def test_a_pull_waits_for_the_stream_only_after_writing_through_it(monkeypatch, transport, arrangement, settles):
    if transport is Transport.UCX and not ucx_available():
        pytest.skip("needs ucxx")
    waited = []
    monkeypatch.setattr(inbound.regions, "settle", lambda views: waited.append(len(views)))
    configs = {} if arrangement is None else arrangement_configs(arrangement)

    async def main():
        async with InProcessPair(transports=(transport,), num_blocks=48, **configs) as pair:
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("settle", [7] * 100)
            with await pull_into(pair.d_cache, peer, grant, transport=transport) as landed:
                assert landed.repacked is (arrangement is not None)

    asyncio.run(asyncio.wait_for(main(), 60))
    assert bool(waited) is settles, waited
