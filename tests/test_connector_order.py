"""Two nodes whose layouts differ only in block order (BLNHC / BLHNC): the handshake accepts them,
the decode node lands the blocks in a staging buffer and converts them with
kernels.repack_blocks, and every layer's MLA page, indexer page or QSA keys, and ring rows read
the same through both sides' views. Any other difference is still refused."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

import kernels
from connector import StatusError, Transport, auth_metadata
from connector import prefill_api as pb
from connector import regions  # fault injection: how the gRPC stream reads a region's bytes
from connector.wire import layout_message
from kvcache import BlockLayout
from tests import connector_procs as procs
from tests.connector_harness import InProcessPair, prefill_nodes, run_child  # noqa: F401 (the prefill fixture)

LEASE_S = 1.5


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


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
    deadline = time.monotonic() + 3 * LEASE_S
    while node.counts() != (node.free_blocks, node.free_rings, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert node.counts() == (node.free_blocks, node.free_rings, 0)


# in one process: QSA keys with two heads, both directions, both transports -------------------
async def _pull_and_compare(pair: InProcessPair, transport: Transport, prompt_len: int, request_id: str) -> list[str]:
    peer = await pair.decode.connect(pair.address)
    grant = await peer.prefill(request_id, [7] * prompt_len)
    with await peer.pull(grant, transport=transport, integrity=True) as landed:
        src_layout = pair.prefill.pool.layout
        src = procs.mirror_pool(src_layout, request_id, len(landed.block_ids))
        dst = pair.decode.pool
        assert landed.repacked is peer.repacks
        if peer.repacks:  # the conversion has teeth: the stored bytes differ, the logical views agree
            assert not torch.equal(dst.blocks[landed.block_ids[0]], src.blocks[0])
        return procs.state_differences(dst, landed.block_ids, landed.ring_id, src, range(len(landed.block_ids)), 0,
                                       procs.live_slots(dst.config, prompt_len))


@pytest.mark.parametrize("transport", [Transport.GRPC_STREAM, Transport.UCX], ids=["grpc", "ucx"])
@pytest.mark.parametrize("prefill_order,decode_order", [("BLNHC", "BLHNC"), ("BLHNC", "BLNHC"), ("BLHNC", "BLHNC")],
                         ids=["blnhc-to-blhnc", "blhnc-to-blnhc", "same-order"])
def test_qsa_keys_convert_between_orders(prefill_order, decode_order, transport):
    async def main():
        async with InProcessPair(prefill_config=procs.make_config("qsa-2heads", prefill_order),
                                 decode_config=procs.make_config("qsa-2heads", decode_order),
                                 transports=(transport,)) as pair:
            start = pair.free()
            for i, n in enumerate([1, 33, 3 * 32 + 2]):  # one token, a block and a bit, an open QSA group
                assert await _pull_and_compare(pair, transport, n, f"qsa-{i}") == []
            assert pair.free() == start
    run(main())


def test_equal_orders_land_without_staging(monkeypatch):
    def no_repack(*args, **kwargs):
        raise AssertionError("repack_blocks called for equal layouts")
    monkeypatch.setattr(kernels, "repack_blocks", no_repack)

    async def main():
        async with InProcessPair(prefill_config=procs.make_config("kpool-2heads")) as pair:
            peer = await pair.decode.connect(pair.address)
            assert peer.repacks is False
            grant = await peer.prefill("same", [3] * 100)
            with await peer.pull(grant, transport=Transport.GRPC_STREAM) as landed:
                assert landed.repacked is False
                assert torch.equal(pair.decode.pool.blocks[landed.block_ids[1]],
                                   procs.expected_block(pair.decode.pool.layout, "same", 1))
    run(main())


def test_failed_pull_with_staging_frees_everything(monkeypatch):
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
            with pytest.raises(StatusError) as err:
                await peer.pull(grant, transport=Transport.GRPC_STREAM, integrity=True)
            assert err.value.code is grpc.StatusCode.DATA_LOSS
            assert torch.equal(pair.decode.pool.blocks, before)  # nothing converted into our blocks
            assert pair.free()[2:] == start[2:]
            assert await peer.release(grant.grant_id) is True
            assert pair.free() == start
    run(main())


# refusals: every difference other than the order ------------------------------------------
@pytest.mark.parametrize("decode_name,decode_order,fields", [
    ("kpool", "BLHNC", ["mla_num_heads", "order"]),
    ("qsa-2heads", "BLNHC", None),
], ids=["order-and-heads", "other-family"])
def test_handshake_refuses_more_than_an_order_difference(decode_name, decode_order, fields):
    async def main():
        async with InProcessPair(prefill_config=procs.make_config("kpool-2heads", "BLNHC"),
                                 decode_config=procs.make_config(decode_name, decode_order)) as pair:
            with pytest.raises(StatusError) as err:
                await pair.decode.connect(pair.address)
            return err.value
    err = run(main())
    assert err.code is grpc.StatusCode.FAILED_PRECONDITION
    theirs = procs.make_config(decode_name, decode_order).hash_fields()
    ours = procs.make_config("kpool-2heads").hash_fields()
    expected = fields or sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    assert f"fields {expected}" in err.message


def test_handshake_refuses_an_order_difference_whose_hash_does_not_match():
    async def main():
        async with InProcessPair(prefill_config=procs.make_config("kpool-2heads", "BLNHC")) as pair:
            forged = layout_message(BlockLayout(procs.make_config("kpool-2heads", "BLHNC")))
            forged.layout_hash = "0" * 64  # its fields claim an order-only difference; its hash says otherwise
            async with grpc.aio.insecure_channel(pair.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb.PrefillServiceStub(channel).Handshake(
                        pb.HandshakeRequest(engine_id="forger", layout=forged), timeout=5, metadata=auth_metadata(procs.TOKEN))
            return err.value
    err = run(main())
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "['order', 'layout_hash']" in err.details()
