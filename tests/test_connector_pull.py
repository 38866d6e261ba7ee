"""A pull takes the request's whole reservation in one piece: the prompt lands in the first
``grant.num_blocks`` blocks, the LandedRequest owns every block (and the ring) until released,
and a pull that fails, on either transport and at any step, frees all of it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from connector import StatusError, Transport
from connector.shared import regions  # fault injection: how the gRPC stream reads and writes a region's bytes
from tests import connector_procs as procs
from tests.connector_harness import InProcessPair
from tests.polling import until

GRPC = Transport.GRPC_STREAM


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.parametrize("transport", [GRPC, Transport.UCX], ids=["grpc", "ucx"])
@pytest.mark.parametrize("prompt_len,extra", [(1, 1), (100, 3), (128, 0)], ids=["one-token", "block-and-a-bit", "exact"])
def test_a_larger_reservation_is_owned_by_the_landed_request(transport, prompt_len, extra):
    async def main():
        async with InProcessPair(transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("reserved", [6] * prompt_len)
            reserve = grant.num_blocks + extra
            landed = await peer.pull(grant, reserve_blocks=reserve, transport=transport, integrity=True)
            assert len(landed.block_ids) == len(set(landed.block_ids)) == reserve
            assert pair.free()[2:] == (start[2] - reserve, start[3] - 1)
            assert pair.free()[:2] == start[:2]  # the grant was released on the prefill node
            layout = pair.decode.pool.layout
            for j, b in enumerate(landed.block_ids[:grant.num_blocks]):  # the prompt, in block-table order
                assert torch.equal(pair.decode.pool.blocks[b], procs.expected_block(layout, "reserved", j)), j
            assert f"blocks={reserve} ({grant.num_blocks} landed)" in repr(landed)
            landed.release()
            assert landed.released and pair.free() == start
            landed.release()  # idempotent
            assert pair.free() == start
    run(main())


def test_a_reservation_smaller_than_the_grant_takes_the_grant():
    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("small", [6] * 200)  # 4 blocks
            with await peer.pull(grant, reserve_blocks=1, transport=GRPC) as landed:
                assert len(landed.block_ids) == grant.num_blocks == 4
                assert pair.free()[2] == start[2] - 4
            assert pair.free() == start
    run(main())


@pytest.mark.parametrize("reserve", [-1, 2.5, "3"])
def test_a_malformed_reservation_is_refused_before_anything_is_taken(reserve):
    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("bad-reserve", [6] * 10)
            with pytest.raises(ValueError, match="reserve_blocks"):
                await peer.pull(grant, reserve_blocks=reserve, transport=GRPC)
            assert pair.free()[2:] == start[2:]
            assert peer.busy  # the grant is still there to pull or release
            assert await peer.release(grant.grant_id) is True
            assert pair.free() == start and not peer.busy
    run(main())


def test_a_reservation_larger_than_the_free_pool_takes_nothing():
    async def main():
        async with InProcessPair(num_blocks=8) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("too-big", [6] * 100)  # 2 blocks
            with pytest.raises(StatusError) as err:
                await peer.pull(grant, reserve_blocks=9, transport=GRPC)
            assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "needs 9 blocks and a ring; free: 8 blocks" in err.value.message
            assert pair.free()[2:] == start[2:]
            assert pair.decode_sample("transfer_failures_total", cause="cache_exhausted") == 1
            assert await peer.release(grant.grant_id) is True
    run(main())


def _corrupt_the_stream(monkeypatch) -> None:
    real = regions.host_bytes

    def flip_one_byte(view):
        data = bytearray(real(view))
        data[-1] ^= 0x08
        return bytes(data)
    monkeypatch.setattr(regions, "host_bytes", flip_one_byte)


def _fail_on_a_chunk(monkeypatch) -> None:
    def fail(view, data):
        raise RuntimeError("injected failure while landing a chunk")
    monkeypatch.setattr(regions, "write_bytes", fail)


@pytest.mark.parametrize("fault,code", [
    (_corrupt_the_stream, grpc.StatusCode.DATA_LOSS),
    (_fail_on_a_chunk, grpc.StatusCode.UNAVAILABLE),
], ids=["corrupt-bytes", "chunk-write-fails"])
def test_a_failed_pull_with_a_reservation_frees_all_of_it(monkeypatch, fault, code):
    fault(monkeypatch)

    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("doomed", [2] * 300)  # 5 blocks
            with pytest.raises(StatusError) as err:
                await peer.pull(grant, reserve_blocks=grant.num_blocks + 6, transport=GRPC, integrity=True)
            assert err.value.code is code, err.value
            assert pair.free()[2:] == start[2:]  # every reserved block and the ring came back
            assert not peer.busy
            assert await peer.release(grant.grant_id) is True
            assert pair.free() == start
            monkeypatch.undo()  # the next pull, into the same blocks, lands byte for byte
            grant = await peer.prefill("after", [2] * 300)
            with await peer.pull(grant, reserve_blocks=grant.num_blocks + 6, transport=GRPC, integrity=True) as landed:
                assert all(torch.equal(pair.decode.pool.blocks[b], procs.expected_block(pair.decode.pool.layout, "after", j))
                           for j, b in enumerate(landed.block_ids[:grant.num_blocks]))
            assert pair.free() == start
    run(main())


def test_a_failed_ucx_pull_with_a_reservation_retires_its_receives_and_frees_all_of_it():
    async def main():
        async with InProcessPair(transports=(Transport.UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            ucx = pair.decode.ucx
            real = ucx.post_receives

            def post_then_fail(views, tag_base):
                real(views, tag_base)
                raise RuntimeError("injected failure after posting the receives")
            ucx.post_receives = post_then_fail
            try:
                grant = await peer.prefill("ucx-doomed", [4] * 250)
                with pytest.raises(StatusError) as err:
                    await peer.pull(grant, reserve_blocks=grant.num_blocks + 2, transport=Transport.UCX)
            finally:
                del ucx.post_receives
            assert err.value.code is grpc.StatusCode.UNAVAILABLE and "injected failure" in err.value.message
            assert pair.free()[2:] == start[2:]
            assert await peer.release(grant.grant_id) is True
            grant = await peer.prefill("ucx-after", [4] * 250)
            with await peer.pull(grant, reserve_blocks=grant.num_blocks + 2, transport=Transport.UCX) as landed:
                assert all(torch.equal(pair.decode.pool.blocks[b],
                                       procs.expected_block(pair.decode.pool.layout, "ucx-after", j))
                           for j, b in enumerate(landed.block_ids[:grant.num_blocks]))
            assert pair.free() == start
    run(main())


def test_a_pull_cancelled_while_releasing_its_grant_frees_what_landed():
    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            real_release, releasing = peer.release, asyncio.Event()

            async def stalled_release(grant_id, **_):
                releasing.set()
                await asyncio.Event().wait()
            peer.release = stalled_release
            grant = await peer.prefill("impatient", [3] * 150)
            pull = asyncio.ensure_future(peer.pull(grant, reserve_blocks=grant.num_blocks + 4, transport=GRPC))
            await asyncio.wait_for(releasing.wait(), 10)
            assert pair.free()[2] == start[2] - grant.num_blocks - 4  # landed, not yet handed to the caller
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            assert pair.free()[2:] == start[2:]
            del peer.release
            assert await real_release(grant.grant_id) is True
            assert pair.free() == start
    run(main())


@pytest.mark.parametrize("transport", [GRPC, Transport.UCX], ids=["grpc", "ucx"])
def test_the_grant_names_the_source_and_the_timeline_accounts_for_the_pull(transport):
    async def main():
        async with InProcessPair(transports=(transport,)) as pair:
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("timed", [5] * 300)
            assert len(grant.src_block_ids) == grant.num_blocks and grant.src_ring_id >= 0
            held = pair.prefill.leases.live(grant.grant_id)
            assert (grant.src_block_ids, grant.src_ring_id) == (held.block_ids, held.ring_id)
            with await peer.pull(grant, transport=transport, integrity=True) as landed:
                t = landed.timeline
                phases = (t.control_ms, t.post_ms, t.wire_ms, t.completion_ms, t.verify_ms)
                assert all(p >= 0 for p in phases), t
                assert t.total_ms == pytest.approx(sum(phases))
                assert t.total_ms <= landed.seconds * 1000 + 1e-6  # the phases lie inside the pull's own time
                assert t.total_ms >= 0.2 * landed.seconds * 1000, (t, landed.seconds)
    run(main())


def test_a_prefill_response_that_names_too_few_source_blocks_is_refused_and_its_grant_released():
    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            real = peer._prefill_call

            async def short(request):  # the prefill node's answer, one source block short
                response = await real(request)
                del response.src_block_ids[-1]
                return response
            peer._prefill_call = short
            with pytest.raises(StatusError) as err:
                await peer.prefill("short", [5] * 300)
            assert err.value.code is grpc.StatusCode.INTERNAL and "source blocks" in err.value.message
            async def freed():
                return pair.free() == start
            await until(freed, "the grant released in the background", 2.0, 0.02)
    run(main())


def test_a_ucx_pull_without_integrity_waits_on_its_receives_alone():
    async def main():
        async with InProcessPair(transports=(Transport.UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            for i in range(3):
                grant = await peer.prefill(f"fast-{i}", [4] * 250)
                with await peer.pull(grant, transport=Transport.UCX) as landed:
                    t = landed.timeline
                    assert t.control_ms == t.completion_ms == 0.0 and t.wire_ms > 0, t
                    layout = pair.decode.pool.layout
                    for j, b in enumerate(landed.block_ids[:grant.num_blocks]):
                        assert torch.equal(pair.decode.pool.blocks[b], procs.expected_block(layout, f"fast-{i}", j)), j
            async def freed():  # the streams end in the background, then the prefill node frees its blocks
                return pair.free() == start
            await until(freed, "every block free on both sides", 2.0, 0.02)
            assert pair.registry.get_sample_value("kpoolpd_prefill_transfer_failures_total", {"cause": "pull_aborted"}) is None
    run(main())
