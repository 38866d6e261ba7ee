"""A pull lands in the allocation its caller made (the connector never allocates): the prompt in the
allocation's first blocks, the ring in its ring. The allocation stays the caller's whatever the pull's
outcome: a pull that fails, on either transport and at any step, leaves it held and releases nothing
(the caller releases it, and the grant). An allocation the pull cannot land in (released, without a
ring, of another node's cache, too small) is refused with a ValueError before anything is sent."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
import torch

from kpool_pd.connector import StatusError, Transport
from kpool_pd.connector.shared import regions  # fault injection: how the gRPC stream reads and writes a region's bytes
from kpool_pd.kvcache import CacheExhaustedError, NodeCache
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.pulls import pull_into

GRPC = Transport.GRPC_STREAM


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


@pytest.mark.parametrize("transport", [GRPC, Transport.UCX], ids=["grpc", "ucx"])
@pytest.mark.parametrize("prompt_len,extra", [(1, 1), (100, 3), (128, 0)], ids=["one-token", "block-and-a-bit", "exact"])
def test_a_larger_allocation_takes_the_prompt_in_its_first_blocks_and_stays_the_callers(transport, prompt_len, extra):
    async def main():
        async with InProcessPair(transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("reserved", [6] * prompt_len)
            reserve = grant.num_blocks + extra
            allocation = pair.d_cache.allocate("reserved", reserve)
            landed = await peer.pull(grant, into=allocation, transport=transport, integrity=True)
            assert not allocation.released and not hasattr(landed, "release")  # the pull owns nothing
            assert len(allocation.block_ids) == len(set(allocation.block_ids)) == reserve
            assert landed.prompt_blocks == grant.num_blocks
            assert pair.free()[2:] == (start[2] - reserve, start[3] - 1)
            assert pair.free()[:2] == start[:2]  # the grant was released on the prefill node
            layout = pair.decode.pool.layout
            for j, b in enumerate(allocation.block_ids[:grant.num_blocks]):  # the prompt, in block-table order
                assert torch.equal(pair.decode.pool.blocks[b], procs.expected_block(layout, "reserved", j)), j
            assert f"{grant.num_blocks} blocks landed" in repr(landed) and f"blocks={reserve}," in repr(allocation)
            allocation.release()
            assert allocation.released and pair.free() == start
            allocation.release()  # idempotent
            assert pair.free() == start
    run(main())


def test_a_reservation_smaller_than_the_grant_takes_the_grant():
    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("small", [6] * 200)  # 4 blocks
            with await pull_into(pair.d_cache, peer, grant, reserve_blocks=1, transport=GRPC) as landed:
                assert len(landed.block_ids) == grant.num_blocks == 4 == landed.prompt_blocks
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
            with pytest.raises(ValueError, match=re.escape(f"block count must be an integer >= 0, got {reserve!r}")):
                pair.d_cache.allocate(grant.request_id, reserve)
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
            with pytest.raises(CacheExhaustedError, match="too-big needs 9 blocks and a ring; free: 8 of 8 blocks"):
                pair.d_cache.allocate(grant.request_id, 9)
            assert pair.free()[2:] == start[2:]
            assert peer.busy  # the grant is still there: pulled into an allocation that fits, it lands
            with await pull_into(pair.d_cache, peer, grant, reserve_blocks=8, transport=GRPC) as landed:
                assert not procs.landed_differences(pair.decode.pool, landed, "too-big", 100)[0]
            assert pair.free() == start
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
def test_a_failed_pull_leaves_the_callers_larger_allocation_held(monkeypatch, fault, code):
    fault(monkeypatch)

    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("doomed", [2] * 300)  # 5 blocks
            allocation = pair.d_cache.allocate("doomed", grant.num_blocks + 6)
            with pytest.raises(StatusError) as err:
                await peer.pull(grant, into=allocation, transport=GRPC, integrity=True)
            assert err.value.code is code, err.value
            assert not allocation.released  # the pull released nothing: every block and the ring still held
            assert pair.free()[2:] == (start[2] - grant.num_blocks - 6, start[3] - 1)
            assert not peer.busy
            assert await peer.release(grant.grant_id) is True
            allocation.release()
            assert pair.free() == start
            monkeypatch.undo()  # the next pull, into the same blocks, lands byte for byte
            grant = await peer.prefill("after", [2] * 300)
            with pair.d_cache.allocate("after", grant.num_blocks + 6) as again:
                assert again.block_ids == allocation.block_ids
                await peer.pull(grant, into=again, transport=GRPC, integrity=True)
                assert all(torch.equal(pair.decode.pool.blocks[b], procs.expected_block(pair.decode.pool.layout, "after", j))
                           for j, b in enumerate(again.block_ids[:grant.num_blocks]))
            assert pair.free() == start
    run(main())


def test_a_failed_ucx_pull_retires_its_receives_and_leaves_the_callers_allocation_held():
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
                allocation = pair.d_cache.allocate("ucx-doomed", grant.num_blocks + 2)
                with pytest.raises(StatusError) as err:
                    await peer.pull(grant, into=allocation, transport=Transport.UCX)
            finally:
                del ucx.post_receives
            assert err.value.code is grpc.StatusCode.UNAVAILABLE and "injected failure" in err.value.message
            assert not allocation.released
            assert pair.free()[2:] == (start[2] - grant.num_blocks - 2, start[3] - 1)
            allocation.release()  # no receive into it is posted any more: the next pull may take its blocks
            assert pair.free()[2:] == start[2:]
            assert await peer.release(grant.grant_id) is True
            grant = await peer.prefill("ucx-after", [4] * 250)
            with await pull_into(pair.d_cache, peer, grant, reserve_blocks=grant.num_blocks + 2,
                                 transport=Transport.UCX) as landed:
                assert landed.block_ids == allocation.block_ids
                assert all(torch.equal(pair.decode.pool.blocks[b],
                                       procs.expected_block(pair.decode.pool.layout, "ucx-after", j))
                           for j, b in enumerate(landed.block_ids[:grant.num_blocks]))
            assert pair.free() == start
    run(main())


def test_a_pull_cancelled_while_releasing_its_grant_leaves_what_landed_to_the_caller():
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
            allocation = pair.d_cache.allocate("impatient", grant.num_blocks + 4)
            pull = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=GRPC))
            await asyncio.wait_for(releasing.wait(), 10)
            assert pair.free()[2] == start[2] - grant.num_blocks - 4  # landed, the pull not yet returned
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            assert not allocation.released  # the caller's still, cancelled or not
            assert pair.free()[2:] == (start[2] - grant.num_blocks - 4, start[3] - 1)
            allocation.release()
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
            with await pull_into(pair.d_cache, peer, grant, transport=transport, integrity=True) as landed:
                t = landed.timeline
                phases = (t.post_ms, t.wire_ms, t.completion_ms, t.verify_ms)
                assert all(p >= 0 for p in phases), t
                assert t.total_ms == pytest.approx(sum(phases))
                assert t.total_ms <= landed.seconds * 1000 + 1e-6  # the phases lie inside the pull's own time
                # each phase was measured; how much of the pull's wall time they cover depends on how busy
                # the machine is (the rest is waiting to be scheduled), so no share of it is asserted
                assert t.post_ms > 0 and t.wire_ms > 0 and t.total_ms > 0, t
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
                with await pull_into(pair.d_cache, peer, grant, transport=Transport.UCX) as landed:
                    t = landed.timeline
                    assert t.completion_ms == 0.0 and t.wire_ms > 0, t
                    layout = pair.decode.pool.layout
                    for j, b in enumerate(landed.block_ids[:grant.num_blocks]):
                        assert torch.equal(pair.decode.pool.blocks[b], procs.expected_block(layout, f"fast-{i}", j)), j
            async def freed():  # the streams end in the background, then the prefill node frees its blocks
                return pair.free() == start
            await until(freed, "every block free on both sides", 2.0, 0.02)
            assert pair.registry.get_sample_value("kpoolpd_prefill_transfer_failures_total", {"cause": "pull_aborted"}) is None
    run(main())


# what pull asks of the allocation it lands in -----------------------------------------------------
def _released(allocation):
    allocation.release()
    return allocation


UNFIT = {  # (the pair, the grant of 4 blocks) -> an allocation the pull cannot land in
    "released": lambda pair, grant: _released(pair.d_cache.allocate(grant.request_id, grant.num_blocks)),
    "without-a-ring": lambda pair, grant: pair.d_cache.allocate(grant.request_id, grant.num_blocks, ring=False),
    "of-another-cache": lambda pair, grant: NodeCache(procs.CONFIG, num_blocks=32, num_rings=4).allocate(
        grant.request_id, grant.num_blocks),
    "a-block-short": lambda pair, grant: pair.d_cache.allocate(grant.request_id, grant.num_blocks - 1),
    "not-an-allocation": lambda pair, grant: None,
}


@pytest.mark.parametrize("transport", [GRPC, Transport.UCX], ids=["grpc", "ucx"])
@pytest.mark.parametrize("case", list(UNFIT))
def test_an_allocation_the_pull_cannot_land_in_is_refused_before_anything_is_sent(transport, case):
    async def main():
        async with InProcessPair(transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("unfit", [6] * 200)  # 4 blocks
            attempts, real = [], peer._pull_and_release  # every pull that gets as far as the wire shows here
            peer._pull_and_release = lambda *a, **k: attempts.append(a) or real(*a, **k)
            unfit = UNFIT[case](pair, grant)
            before = pair.free()
            with pytest.raises(ValueError) as err:
                await peer.pull(grant, into=unfit, transport=transport, integrity=True)
            assert repr(unfit) in str(err.value) and "unfit" in str(err.value), err.value
            assert f"at least {grant.num_blocks} blocks" in str(err.value)
            assert attempts == [] and pair.free() == before  # nothing sent, nothing taken or released
            for side in (pair.prefill_sample, pair.decode_sample):
                assert side("transfer_bytes_total", transport=transport.label) == 0
                assert side("transfer_failures_total", cause="not_found") == 0
            assert peer.busy and pair.prefill.leases.live(grant.grant_id) is not None  # still pullable
            if unfit is not None:
                unfit.release()
            with await pull_into(pair.d_cache, peer, grant, transport=transport, integrity=True) as landed:
                assert not procs.landed_differences(pair.decode.pool, landed, "unfit", 200)[0]
            assert attempts and pair.free() == start
    run(main())


@pytest.mark.parametrize("transport", [GRPC, Transport.UCX], ids=["grpc", "ucx"])
def test_a_pull_of_a_released_grant_fails_and_leaves_the_callers_allocation_held(transport):
    async def main():
        async with InProcessPair(transports=(transport,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("gone", [6] * 200)
            assert await peer.release(grant.grant_id) is True
            allocation = pair.d_cache.allocate("gone", grant.num_blocks + 2)
            held = pair.free()
            assert held == (start[0], start[1], start[2] - grant.num_blocks - 2, start[3] - 1)
            with pytest.raises(StatusError) as err:
                await peer.pull(grant, into=allocation, transport=transport)
            assert err.value.code is grpc.StatusCode.NOT_FOUND, err.value
            assert not allocation.released and pair.free() == held  # the pull released nothing
            allocation.release()
            assert pair.free() == start
    run(main())
