"""A cancelled request leaves nothing behind on either side, at once: cancels aimed at each step
of a request (the Prefill call, the pull's stream, the grant's Release), with the prefill node
holding that step until the cancel has happened (real gRPC over loopback, both nodes in this
event loop). The cancelled pull leaves the decode node's allocation to its caller, who may release
it at once (no receive into it is posted any more), and the prefill node frees the grant now (a
Release sent in the background), not when its lease runs out: no lease expires.

Then the same through the decode scheduler: a request cancelled while prefilling, pulling or
releasing frees the allocation it was admitted with, and is counted by the state it was in."""

from __future__ import annotations

import asyncio

import pytest

from kpool_pd.connector import ConnectorConfig, PrefillConnector, Transport
from kpool_pd.decode_worker.jobs import JobState
from tests import connector_procs as procs
from tests.connector_harness import InProcessPair
from tests.polling import until
from tests.pulls import allocation_for
from tests.test_decode_scheduler import PROMPT, Nodes

GRPC = Transport.GRPC_STREAM
LEASE_S = 30.0  # far longer than any test here: only a Release frees a grant in time
FREED_WITHIN_S = 3.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


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


def config() -> ConnectorConfig:
    return ConnectorConfig(peer_token=procs.TOKEN, lease_s=LEASE_S, rpc_timeout_s=5.0, transfer_timeout_s=5.0)


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
        async with Nodes() as nodes:
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
