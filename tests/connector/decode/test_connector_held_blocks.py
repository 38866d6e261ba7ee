"""A pull that skips the blocks the decode node already holds (a prefix-cache hit): the held blocks are
not sent (their bytes stay as they were), the others and the ring land as in a whole pull, fewer bytes
move, and the grant is freed on the prefill node. Held indices out of order or beyond the grant, and
held blocks with DCP, a prompt still computing or a peer of another layout, are refused before a byte
moves."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from kpool_pd.connector import StatusError, Transport
from kpool_pd.connector.shared.plan import without_held
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.pulls import allocation_for, pull_into

PROMPT = [(7 * i + 3) % 251 for i in range(302)]  # 5 blocks of 64 tokens (the last partial), 2 tokens in the ring
SENTINEL = 0xAB


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(120)))


@pytest.mark.parametrize("transport", [Transport.GRPC_STREAM, Transport.UCX], ids=["grpc", "ucx"])
def test_a_pull_with_held_blocks_sends_only_the_others_and_the_ring(transport):
    pytest.importorskip("ucxx") if transport is Transport.UCX else None

    async def main():
        async with InProcessPair(transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            whole_grant = await peer.prefill("whole", PROMPT)
            with await pull_into(pair.d_cache, peer, whole_grant, transport=transport) as whole:
                grant = await peer.prefill("delta", PROMPT)
                source = pair.p_cache.pool
                expected = [source.blocks[b].clone() for b in grant.src_block_ids]  # what the grant holds
                expected_ring = source.rings[grant.src_ring_id].clone()
                blocks = pair.d_cache.pool.blocks
                allocation = allocation_for(pair.d_cache, grant)
                with allocation:
                    held = (0, 1, 2)
                    for index in held:
                        blocks[allocation.block_ids[index]] = SENTINEL
                    delta = await peer.pull(grant, into=allocation, transport=transport, held=held)
                    assert delta.held_blocks == 3 and delta.prompt_blocks == len(expected) == whole.prompt_blocks == 5
                    assert delta.nbytes < whole.nbytes, (delta.nbytes, whole.nbytes)
                    for index, block in enumerate(allocation.block_ids[:5]):
                        if index in held:
                            assert bool((blocks[block] == SENTINEL).all()), f"held block {index} was written"
                        else:
                            assert torch_equal(blocks[block], expected[index]), f"block {index} differs"
                    ring = pair.d_cache.pool.rings[allocation.ring_id]
                    live = grant.ring_live
                    slot = pair.d_cache.pool.layout.ring_slot_bytes
                    span = slice(live.start_slot * slot, (live.start_slot + live.num_slots) * slot)
                    assert live.num_slots and torch_equal(ring[span], expected_ring[span])
            assert pair.free() == start  # both grants released on the prefill node, nothing held here
    run(main())


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


@pytest.mark.parametrize("held,needle", [
    ((1, 0), "indices must increase"),
    ((2, 2), "indices must increase"),
    ((5,), "lie below the 5 blocks"),
    ((-1,), "indices must increase"),
], ids=["out-of-order", "repeated", "beyond", "negative"])
def test_held_indices_out_of_order_or_range_are_refused_naming_them(held, needle):
    with pytest.raises(ValueError, match=needle):
        without_held([10, 11, 12, 13, 14], [0, 1, 2, 3, 4], held)


def test_without_held_keeps_the_pairs_of_the_blocks_not_held():
    assert without_held([10, 11, 12, 13], [0, 1, 2, 3], (0, 2)) == ([11, 13], [1, 3])
    assert without_held([10, 11], [0, 1], ()) == ([10, 11], [0, 1])


def test_held_indices_beyond_the_grant_fail_the_plan_before_anything_is_sent_and_keep_the_grant():
    async def main():
        async with InProcessPair() as pair:
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("bad-held", PROMPT)
            allocation = allocation_for(pair.d_cache, grant)
            with allocation:
                with pytest.raises(StatusError) as err:
                    await peer.pull(grant, into=allocation, transport=Transport.GRPC_STREAM, held=(4, 9))
                assert err.value.code is grpc.StatusCode.INTERNAL and "held block index 9" in err.value.message
                assert pair.prefill.grants_held == 1  # the prefill node kept the grant: no Pull reached it
                pulled = await peer.pull(grant, into=allocation, transport=Transport.GRPC_STREAM, held=(0,))
                assert pulled.held_blocks == 1  # the failed plan left the grant to a good one
    run(main())


def test_held_blocks_need_a_computed_prompt_of_our_layout_without_dcp():
    async def main():
        async with InProcessPair() as pair:
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("pipelined", PROMPT)
            allocation = allocation_for(pair.d_cache, grant)
            with allocation:
                with pytest.raises(ValueError, match="held blocks are skipped only"):
                    await peer.pull(replace(grant, pipelined=True), into=allocation, held=(0,))
                await peer.release(grant.grant_id)
    run(main())
