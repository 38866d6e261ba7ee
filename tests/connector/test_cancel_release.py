"""A cancelled request leaves nothing behind on either side, at once: cancels aimed at each step
of a request (the Prefill call, the pull's stream, the grant's Release), with the prefill node
holding that step until the cancel has happened (real gRPC over loopback, both nodes in this
event loop). The cancelled pull leaves the decode node's allocation to its caller, who may release
it at once (no receive into it is posted any more), and the prefill node frees the grant now (a
Release sent in the background), not when its lease runs out: no lease expires.

A background Release that the prefill node fails, or answers later than a loaded node may, is sent
again (or waited for) until it is answered, not left to the lease; one that never is ends with the
lease.

Then the same through the decode scheduler: a request cancelled while prefilling, pulling or
releasing frees the allocation it was admitted with, and is counted by the state it was in."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kpool_pd.connector import ConnectorConfig, PrefillConnector, Transport
from kpool_pd.connector.decode.releases import RELEASE_RETRY_S
from kpool_pd.decode_worker.jobs import JobState
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.pulls import allocation_for
from tests.workers.test_decode_scheduler import PROMPT, Nodes

GRPC = Transport.GRPC_STREAM
LEASE_S = 30.0  # far longer than any test here: only a Release frees a grant in time
FREED_WITHIN_S = 3.0
SLOW_RELEASE_S = 3.0  # a loaded prefill node's answer: within rpc_timeout_s (5 s), not within 2 s


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


class Hold:
    """Where the prefill node holds a step: ``entered`` is set when a call reaches it; the call
    goes on once ``go`` is set (or, for a stream, when the caller cancels it)."""

    def __init__(self) -> None:
        self.entered, self.go = asyncio.Event(), asyncio.Event()

    async def __call__(self) -> None:
        self.entered.set()
        await self.go.wait()


def hold_release(prefill: PrefillConnector) -> Hold:
    hold, real = Hold(), prefill.Release

    async def held(request, context):
        await hold()
        return await real(request, context)
    prefill.Release = held  # before the server registers the servicer
    return hold


def hold_pull_stream(prefill: PrefillConnector) -> Hold:
    """The Pull stream sends its first message (the grant), then stalls until cancelled."""
    hold, real = Hold(), prefill.pull_messages  # a Pull call's and a pull session's

    async def held(request):
        stream = real(request)
        try:
            yield await stream.__anext__()
            await hold()
            async for message in stream:
                yield message
        finally:
            await stream.aclose()
    prefill.pull_messages = held
    return hold


def failing_release(prefill: PrefillConnector, failures: int | None) -> list[int]:
    """The prefill node refuses its first ``failures`` Releases UNAVAILABLE (None: every one), as a
    node too loaded to take a call may; the returned list counts the Releases that reached it."""
    calls, real = [], prefill.Release

    async def failing(request, context):
        calls.append(1)
        if failures is None or len(calls) <= failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "too busy")
        return await real(request, context)
    prefill.Release = failing
    return calls


def slow_release(prefill: PrefillConnector, delay_s: float) -> None:
    """The prefill node answers each Release ``delay_s`` late (a caller that gives up first cancels it)."""
    real = prefill.Release

    async def slow(request, context):
        await asyncio.sleep(delay_s)
        return await real(request, context)
    prefill.Release = slow


def config(**kwargs) -> ConnectorConfig:
    return ConnectorConfig(peer_token=procs.TOKEN, **{"lease_s": LEASE_S, "rpc_timeout_s": 5.0,
                                                     "transfer_timeout_s": 5.0, **kwargs})


async def freed(pair: InProcessPair, start) -> None:
    async def back() -> bool:
        return pair.free() == start
    await until(back, "every block and ring free again on both sides", FREED_WITHIN_S)
    assert pair.prefill_sample("leases_expired_total") == 0
    assert pair.prefill.grants_held == 0


def test_a_pull_cancelled_during_its_release_frees_both_sides_at_once():
    async def main():
        pair = InProcessPair(config=config())
        hold = hold_release(pair.prefill)
        async with pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("leaves-while-releasing", [3] * 150)
            allocation = allocation_for(pair.d_cache, grant, reserve_blocks=grant.num_blocks + 2)
            pull = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=GRPC))
            await asyncio.wait_for(hold.entered.wait(), 10)  # landed; the Release is at the prefill node
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            assert not allocation.released  # the cancel leaves the landed blocks to their caller,
            allocation.release()  # who frees them at once
            assert pair.free()[2:] == start[2:]
            hold.go.set()  # the prefill node answers the Release only now: it must not have been cancelled
            await freed(pair, start)
    run(main())


def test_a_pull_cancelled_while_its_stream_runs_releases_the_grant():
    async def main():
        pair = InProcessPair(config=config())
        hold = hold_pull_stream(pair.prefill)
        async with pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("leaves-while-pulling", [4] * 200)
            allocation = allocation_for(pair.d_cache, grant)
            pull = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=GRPC))
            await asyncio.wait_for(hold.entered.wait(), 10)
            assert pair.free()[2] < start[2]  # the decode node holds the pull's blocks
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            assert not allocation.released
            allocation.release()
            assert pair.free()[2:] == start[2:]
            await freed(pair, start)
    run(main())


async def cancel_a_pull(pair: InProcessPair, request_id: str):
    """Prefill, start a pull whose stream the prefill node holds, cancel it (the grant's Release goes
    in the background) and free the decode node's allocation; the peer."""
    hold = hold_pull_stream(pair.prefill)
    peer = await pair.decode.connect(pair.address)
    grant = await peer.prefill(request_id, [6] * 150)
    allocation = allocation_for(pair.d_cache, grant)
    pull = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=GRPC))
    await asyncio.wait_for(hold.entered.wait(), 10)
    pull.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pull
    allocation.release()
    return peer


async def idle(peer) -> None:
    async def quiet() -> bool:
        return not peer.busy
    await until(quiet, "the peer idle (its background Release over)", FREED_WITHIN_S)


def test_a_background_release_that_fails_is_sent_again_until_the_grant_is_freed():
    async def main():
        pair = InProcessPair(config=config())
        calls = failing_release(pair.prefill, failures=2)
        async with pair:
            start = pair.free()
            peer = await cancel_a_pull(pair, "release-fails-twice")
            await freed(pair, start)  # by the third Release, not by the lease (30 s)
            await idle(peer)
            assert len(calls) == 3
    run(main())


def test_a_background_release_outlives_its_closed_peer_and_goes_through_the_node_handshaken_again():
    """The peer a background Release was queued on is closed (a failed pull disconnects it) and the node
    is handshaken again: the Release goes on through the new peer and the grant is freed well before its
    lease (30 s) ends, not left to it."""
    async def main():
        pair = InProcessPair(config=config())
        calls, refusing, real = [], [True], pair.prefill.Release

        async def refused_until_reconnected(request, context):
            calls.append(1)
            if refusing[0]:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "too busy")
            return await real(request, context)
        pair.prefill.Release = refused_until_reconnected
        async with pair:
            start = pair.free()
            old = await cancel_a_pull(pair, "release-outlives-its-peer")

            async def tried() -> bool:
                return len(calls) >= 1
            await until(tried, "the background Release refused once", FREED_WITHIN_S)
            assert await pair.decode.disconnect(old) == 1 and old.closed
            new = await pair.decode.connect(pair.address)
            refusing[0] = False
            await freed(pair, start)

            async def over() -> bool:
                return len(pair.decode.releases) == 0 and not old.busy and not new.busy
            await until(over, "the background Release over", FREED_WITHIN_S)
    run(main())


def test_a_background_release_answered_late_is_waited_for():
    """A loaded prefill node answers after the 2 s a background Release used to wait; giving up then
    cancelled the call on the node too, which left the grant held until its lease ran out."""
    async def main():
        pair = InProcessPair(config=config())
        slow_release(pair.prefill, SLOW_RELEASE_S)
        async with pair:
            start = pair.free()
            await cancel_a_pull(pair, "release-answered-late")
            await asyncio.sleep(SLOW_RELEASE_S)
            await freed(pair, start)
    run(main())


def test_a_background_release_never_answered_ends_with_the_lease():
    """Sent again until the grant's lease ran out (it cannot be held longer), then given up."""
    lease_s = 1.0

    async def main():
        pair = InProcessPair(config=config(lease_s=lease_s))
        calls = failing_release(pair.prefill, failures=None)
        async with pair:
            peer = await cancel_a_pull(pair, "release-never-answered")
            await asyncio.sleep(lease_s)
            await idle(peer)
            assert 2 <= len(calls) <= 1 + lease_s / RELEASE_RETRY_S[0]  # backed off, not a busy loop
    run(main())


def test_a_prefill_whose_caller_left_as_its_answer_came_is_released():
    """The race a client's cancel can hit: the node granted and its answer is here, but the caller
    is cancelled before it reads it. Nobody knows the grant; it must be released anyway."""
    async def main():
        async with InProcessPair(config=config()) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            real, caller = peer._prefill_call, None

            async def answered_as_the_caller_leaves(request):
                response = await real(request)
                caller.cancel()
                return response
            peer._prefill_call = answered_as_the_caller_leaves
            caller = asyncio.ensure_future(peer.prefill("leaves-as-granted", [5] * 120))
            with pytest.raises(asyncio.CancelledError):
                await caller
            await freed(pair, start)

            async def idle() -> bool:
                return not peer.busy
            await until(idle, "the peer idle (its background Release answered)", FREED_WITHIN_S)
    run(main())


# through the scheduler --------------------------------------------------------------------
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("state", [JobState.PREFILLING, JobState.PULLING, JobState.RELEASING],
                         ids=lambda s: s.value)
def test_a_request_cancelled_while_fetching_frees_everything_and_is_counted_by_state(monkeypatch, state):
    hold = Hold()
    if state is JobState.PREFILLING:
        real_prefill = PrefillConnector.Prefill

        async def held(self, request, context):
            await hold()
            return await real_prefill(self, request, context)
        monkeypatch.setattr(PrefillConnector, "Prefill", held)
    elif state is JobState.PULLING:
        real_pull = PrefillConnector.pull_messages

        async def held(self, request):
            stream = real_pull(self, request)
            try:
                yield await stream.__anext__()
                await hold()
                async for message in stream:
                    yield message
            finally:
                await stream.aclose()
        monkeypatch.setattr(PrefillConnector, "pull_messages", held)
    else:
        real_release = PrefillConnector.Release

        async def held(self, request, context):
            await hold()
            return await real_release(self, request, context)
        monkeypatch.setattr(PrefillConnector, "Release", held)

    async def main():
        async with Nodes(push=state is JobState.RELEASING) as nodes:  # the Prefill and Pull held above: no push
            start = nodes.free()
            job = nodes.scheduler.submit(f"cancel-{state.value}", PROMPT, 20)
            await nodes.scheduler.wait_admitted(job)

            async def handler():  # what GenerateService does around fetch
                try:
                    await nodes.scheduler.fetch(job)
                finally:
                    nodes.scheduler.abandon(job, "cancelled")
            task = asyncio.ensure_future(handler())
            await asyncio.wait_for(hold.entered.wait(), 30)
            assert job.state is state
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert nodes.free()[2:] == start[2:] and nodes.scheduler.idle
            assert nodes.sample("reserved_blocks") == 0
            assert nodes.sample("cancelled_total", state=state.value) == 1
            hold.go.set()  # a held Prefill or Release now completes; its grant is released

            async def back() -> bool:
                return nodes.free() == start
            await until(back, "the prefill node's blocks free again", FREED_WITHIN_S)
            assert nodes.prefill.grants_held == 0  # released: a lease of 30 s cannot have run out
    run(main())
