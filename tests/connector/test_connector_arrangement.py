"""Two nodes whose layouts arrange the same cache otherwise (block size, block order BLNHC / BLHNC,
kernel page): the handshake accepts them, the decode node lands the blocks in a staging buffer
and places them with kernels.repack_tokens, and every layer's MLA rows, kpool entries and scales
or QSA keys of the prompt's positions, and the ring's live rows, read the same through both
sides' views. Any difference in what the bytes mean is still refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kpool_pd import kernels
from kpool_pd.connector import StatusError, Transport, open_channel
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared import regions  # fault injection: how the gRPC stream reads a region's bytes
from kpool_pd.connector.shared.compat import ARRANGING_FIELDS
from kpool_pd.connector.shared.wire import layout_message
from kpool_pd.kvcache import BlockLayout
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair, prefill_nodes, run_child  # noqa: F401 (the prefill fixture)
from tests.support.arrangements import ARRANGEMENTS, arranged
from tests.support.deadlines import patient
from tests.support.polling import wait_for
from tests.support.pulls import allocation_for, pull_into

LEASE_S = 1.5


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


# real processes: a BLHNC prefill node, a BLNHC decode node -----------------------------------
@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_blhnc_prefill_process_to_blnhc_decode_process(prefill, transport):
    node = prefill(lease_s=LEASE_S, cache="kpool-2heads", order="BLHNC")
    (out,), code = run_child(procs.decode_main, address=node.address, transport=transport, scenario="order",
                             lease_s=LEASE_S, cache="kpool-2heads", order="BLNHC", peer_order="BLHNC")
    assert code == 0
    assert out["repacks"] is True and all(out["repacked"]) and len(out["repacked"]) == 4
    assert out["differences"] == []
    assert out["end_free"] == out["start_free"]
    assert wait_for(lambda: node.counts() == (node.free_blocks, node.free_rings, 0), 3 * LEASE_S), node.counts()


# in one process: both families, block sizes, orders and kernel pages, both transports -------
async def _pull_and_compare(pair: InProcessPair, transport: Transport, prompt_len: int, request_id: str) -> list[str]:
    peer = await pair.decode.connect(pair.address)
    grant = await peer.prefill(request_id, [7] * prompt_len)
    with await pull_into(pair.d_cache, peer, grant, transport=transport, integrity=True) as landed:
        src_layout = pair.prefill.pool.layout
        src = procs.mirror_pool(src_layout, request_id, grant.num_blocks)
        dst = pair.decode.pool
        assert landed.repacked is peer.repacks
        assert len(landed.block_ids) == dst.config.blocks_for_tokens(prompt_len)
        if peer.repacks and src_layout.block_bytes == dst.layout.block_bytes and prompt_len > 1:
            # the conversion has teeth: the stored bytes differ, the views agree
            assert not torch.equal(dst.blocks[landed.block_ids[0]], src.blocks[0])
        return procs.state_differences(dst, landed.block_ids, landed.ring_id, src, range(grant.num_blocks), 0,
                                       procs.live_slots(dst.config, prompt_len), prompt_len)


@pytest.mark.parametrize("transport", [Transport.GRPC_STREAM, Transport.UCX], ids=["grpc", "ucx"])
@pytest.mark.parametrize("name", list(ARRANGEMENTS))
def test_pull_between_arrangements(name, transport):
    cache, prefill_side, decode_side = ARRANGEMENTS[name]

    async def main():
        async with InProcessPair(prefill_config=arranged(cache, *prefill_side),
                                 decode_config=arranged(cache, *decode_side), transports=(transport,),
                                 num_blocks=48) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            assert peer.repacks is (prefill_side != decode_side)
            small, large = sorted((prefill_side[1], decode_side[1]))
            lengths = [1, 3, small - 1, small + 1, large, large + 5, 2 * large + 3]
            for i, n in enumerate(lengths):
                assert await _pull_and_compare(pair, transport, n, f"{name}-{i}") == [], n
            assert pair.free() == start
    run(main())


def test_equal_layouts_land_without_staging(monkeypatch):
    def no_repack(*args, **kwargs):
        raise AssertionError("repack_tokens called for equal layouts")
    monkeypatch.setattr(kernels, "repack_tokens", no_repack)

    async def main():
        async with InProcessPair(prefill_config=procs.make_config("kpool-2heads")) as pair:
            peer = await pair.decode.connect(pair.address)
            assert peer.repacks is False
            grant = await peer.prefill("same", [3] * 100)
            with await pull_into(pair.d_cache, peer, grant, transport=Transport.GRPC_STREAM) as landed:
                assert landed.repacked is False
                assert torch.equal(pair.decode.pool.blocks[landed.block_ids[1]],
                                   procs.expected_block(pair.decode.pool.layout, "same", 1))
    run(main())


def test_failed_pull_with_staging_converts_nothing_and_leaves_the_allocation_to_the_caller(monkeypatch):
    real = regions.host_bytes

    def flip_one_byte(view):
        data = bytearray(real(view))
        data[0] ^= 1
        return bytes(data)
    monkeypatch.setattr(regions, "host_bytes", flip_one_byte)

    async def main():
        async with InProcessPair(prefill_config=procs.make_config("kpool-2heads", "BLHNC"),
                                 decode_config=procs.make_config("kpool-2heads", "BLNHC")) as pair:
            start = pair.free()
            before = pair.decode.pool.blocks.clone()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("corrupt", [1] * 200)
            allocation = allocation_for(pair.d_cache, grant)
            with pytest.raises(StatusError) as err:
                await peer.pull(grant, into=allocation, transport=Transport.GRPC_STREAM, integrity=True)
            assert err.value.code is grpc.StatusCode.DATA_LOSS
            assert torch.equal(pair.decode.pool.blocks, before)  # nothing converted into our blocks
            assert not allocation.released and pair.free()[2:] == (start[2] - allocation.num_blocks, start[3] - 1)
            allocation.release()
            assert pair.free()[2:] == start[2:]
            assert await peer.release(grant.grant_id) is True
            assert pair.free() == start
    run(main())


# refusals: every difference in what the bytes mean -----------------------------------------
@pytest.mark.parametrize("decode_name,decode_order,block_size,fields", [
    ("kpool", "BLHNC", None, ["mla_num_heads"]),
    ("kpool", "BLNHC", 128, ["mla_num_heads"]),
    ("qsa-2heads", "BLNHC", None, None),
], ids=["order-and-heads", "block-size-and-heads", "other-family"])
def test_handshake_refuses_a_difference_in_meaning(decode_name, decode_order, block_size, fields):
    decode_config = arranged(decode_name, decode_order, block_size)

    async def main():
        async with InProcessPair(prefill_config=procs.make_config("kpool-2heads", "BLNHC"),
                                 decode_config=decode_config) as pair:
            with pytest.raises(StatusError) as err:
                await pair.decode.connect(pair.address)
            return err.value
    err = run(main())
    assert err.code is grpc.StatusCode.FAILED_PRECONDITION
    theirs = decode_config.hash_fields()
    ours = procs.make_config("kpool-2heads").hash_fields()
    expected = fields or sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)
                                and k not in ARRANGING_FIELDS)
    assert f"fields {expected}" in err.message


def test_handshake_refuses_an_order_difference_whose_hash_does_not_match():
    async def main():
        async with InProcessPair(prefill_config=procs.make_config("kpool-2heads", "BLNHC")) as pair:
            forged = layout_message(BlockLayout(procs.make_config("kpool-2heads", "BLHNC")))
            forged.layout_hash = "0" * 64  # its fields claim an order-only difference; its hash says otherwise
            async with open_channel(pair.address, None, peer_token=procs.TOKEN, challenge_timeout_s=5.0) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb.PrefillServiceStub(channel).Handshake(
                        pb.HandshakeRequest(engine_id="forger", layout=forged), timeout=5)
            return err.value
    err = run(main())
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "['order', 'layout_hash']" in err.details()
