"""The pull session (kpool_pd/connector/decode/pull_session.py, kpool_pd/connector/prefill/pull_session_server.py): UCX pulls on one stream
per prefill node, byte for byte as over Pull calls; what the session refuses, each pull on its own; a pull
cancelled on it is stopped on the prefill node and both nodes are freed; a session that breaks fails its pulls with
UNAVAILABLE and the next pull opens a new one; a prefill node that serves no session gets Pull calls."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kpool_pd.connector import ConnectorConfig, StatusError, Transport, ucx_available
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.connector import PrefillConnector
from kpool_pd.connector.shared.errors import status_code
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.pulls import allocation_for, pull_into

pytestmark = pytest.mark.skipif(not ucx_available(), reason="the pull session carries UCX pulls; ucxx is not installed")
UCX = Transport.UCX
CONFIG = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


async def freed(pair: InProcessPair, start) -> None:
    async def back() -> bool:
        return pair.free() == start
    await until(back, "every block and ring free again on both sides", 10)


def stall_pulls(prefill: PrefillConnector) -> tuple[asyncio.Event, asyncio.Event]:
    """Make every pull on ``prefill`` wait, no byte sent, until it is stopped: (started, stopped) events."""
    started, stopped, real = asyncio.Event(), asyncio.Event(), prefill.pull_messages

    async def stalled(request):
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()
        async for message in real(request):
            yield message
    prefill.pull_messages = stalled
    return started, stopped


def test_pulls_share_one_session_and_land_byte_for_byte():
    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            calls = []
            real_pull = peer._pull
            peer._pull = lambda *a, **k: calls.append(a) or real_pull(*a, **k)  # a Pull call would show here
            grants = [await peer.prefill(f"s{i}", [i + 1] * n) for i, n in enumerate((1, 64, 65, 300))]  # 4 rings
            landed = await asyncio.gather(*(pull_into(pair.d_cache, peer, g, transport=UCX) for g in grants))
            for grant, request in zip(grants, landed):
                with request:
                    differences, compared = procs.landed_differences(pair.decode.pool, request, grant.request_id,
                                                                     grant.prompt_len)
                    assert not differences and compared > 0
            assert calls == [] and peer._session is not None and peer._session._call is not None
            await freed(pair, start)
    run(main())


REFUSED = {
    "grpc-stream-transport": (lambda g: dict(transport=pb.TRANSPORT_GRPC_STREAM), grpc.StatusCode.INVALID_ARGUMENT,
                              "UCX pulls only"),
    "unknown-grant": (lambda g: dict(grant_id="no-such-grant"), grpc.StatusCode.NOT_FOUND, "unknown"),
    "an-engine-not-handshaken": (lambda g: dict(engine_id="decode-other"), grpc.StatusCode.FAILED_PRECONDITION,
                                 "has not handshaken"),
    "no-engine-secret": (lambda g: dict(engine_secret=b""), grpc.StatusCode.PERMISSION_DENIED, "engine secret"),
    "wrong-engine-secret": (lambda g: dict(engine_secret=b"x" * 32), grpc.StatusCode.PERMISSION_DENIED, "engine secret"),
    "zero-tag-base": (lambda g: dict(ucx_tag_base=0), grpc.StatusCode.INVALID_ARGUMENT, "ucx_tag_base"),
    "region-beyond-the-grant": (lambda g: dict(regions=[pb.Region(kind=pb.POOL_KIND_BLOCKS, offset=0, nbytes=1 << 40)]),
                                grpc.StatusCode.INVALID_ARGUMENT, "is not served"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_pull_ends_with_its_status_and_the_session_serves_the_next(case):
    change, code, needle = REFUSED[case]

    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("held", [3] * 130)
            stub = pb.PrefillServiceStub(peer._channel)
            session = stub.PullSession(timeout=10)
            fields = dict(grant_id=grant.grant_id, engine_id="decode-t", transport=pb.TRANSPORT_UCX, ucx_tag_base=7,
                          engine_secret=peer._secret) \
                | change(grant)
            await session.write(pb.PullSessionRequest(pull=pb.PullRequest(**fields)))
            answer = await session.read()
            assert answer.grant_id == fields["grant_id"] and answer.WhichOneof("message") == "failure"
            assert status_code(answer.failure.code) is code
            assert needle in answer.failure.message, answer.failure.message
            await session.done_writing()
            assert await session.read() is grpc.aio.EOF  # nothing runs on it: it ends once the client's side did
            with await pull_into(pair.d_cache, peer, grant, transport=UCX) as landed:  # the grant was left as it was
                assert not procs.landed_differences(pair.decode.pool, landed, "held", 130)[0]
            await freed(pair, start)
    run(main())


def test_a_duplicate_pull_on_one_session_is_refused():
    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("dup", [3] * 10)
            request = pb.PullRequest(grant_id=grant.grant_id, engine_id="decode-t", transport=pb.TRANSPORT_UCX,
                                     ucx_tag_base=9, engine_secret=peer._secret)
            peer._session.open(request)
            with pytest.raises(StatusError) as err:
                peer._session.open(request)
            assert err.value.code is grpc.StatusCode.ALREADY_EXISTS
            peer._session.cancel(grant.grant_id)
            await peer.release(grant.grant_id)
    run(main())


def test_a_pull_cancelled_on_the_session_is_stopped_on_the_prefill_node_and_both_nodes_are_freed():
    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            started, stopped = stall_pulls(pair.prefill)
            grant = await peer.prefill("c", [5] * 200)
            allocation = allocation_for(pair.d_cache, grant)
            pull = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=UCX))
            await asyncio.wait_for(started.wait(), 10)
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            assert not allocation.released  # the caller's to release, cancelled or not
            allocation.release()
            await asyncio.wait_for(stopped.wait(), 10)
            await freed(pair, start)
            assert pair.prefill.grants_held == 0
    run(main())


def test_a_session_that_breaks_fails_its_pulls_and_the_next_pull_opens_a_new_one():
    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            real = pair.prefill.pull_messages
            blocked, _ = stall_pulls(pair.prefill)
            grant = await peer.prefill("b", [6] * 100)
            allocation = allocation_for(pair.d_cache, grant)
            pull = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=UCX))
            await asyncio.wait_for(blocked.wait(), 10)
            first = peer._session._call
            first.cancel()  # the stream breaks (as when the connection resets)
            with pytest.raises(StatusError) as err:
                await pull
            assert err.value.code is grpc.StatusCode.UNAVAILABLE and "pull session ended" in err.value.message
            assert await peer.release(grant.grant_id) is True  # a failed pull leaves its grant to the caller,
            assert not allocation.released  # and its allocation
            allocation.release()
            pair.prefill.pull_messages = real
            again = await peer.prefill("b2", [6] * 100)
            with await pull_into(pair.d_cache, peer, again, transport=UCX) as landed:
                assert not procs.landed_differences(pair.decode.pool, landed, "b2", 100)[0]
            assert peer._session._call is not first
            await freed(pair, start)
    run(main())


def test_a_prefill_node_without_sessions_gets_pull_calls(monkeypatch):
    real = PrefillConnector.Handshake

    async def old_handshake(self, request, context):
        response = await real(self, request, context)
        response.pull_session = False  # as a node of an earlier version answers
        return response
    monkeypatch.setattr(PrefillConnector, "Handshake", old_handshake)

    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            assert peer._session is None
            grant = await peer.prefill("old", [8] * 90)
            with await pull_into(pair.d_cache, peer, grant, transport=UCX) as landed:
                assert not procs.landed_differences(pair.decode.pool, landed, "old", 90)[0]
            await freed(pair, start)
    run(main())


def test_an_idle_session_is_ended_with_a_clear_status_and_its_state_freed():
    """An authenticated peer that opens a PullSession and sends nothing has it ended (DEADLINE_EXCEEDED, naming
    the limit) once the limit passed; a session whose pull runs longer than the limit is not ended; a decode
    node whose own session idled out pulls again on a new one."""
    async def main():
        config = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5),
                                 pull_session_idle_s=0.5)
        async with InProcessPair(config=config, transports=(UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            stub = pb.PrefillServiceStub(peer._channel)
            loop = asyncio.get_running_loop()
            silent = stub.PullSession(timeout=30)
            began = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(silent.read(), 15)
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err.value
            assert "idle" in err.value.details() and "0.5 s" in err.value.details()
            assert loop.time() - began >= 0.5

            async def no_session() -> bool:
                return pair.prefill.pull_sessions_open == 0
            await until(no_session, "the idle session's handler ended", 10)
            # a pull that waits longer than the limit (its prompt computes slowly) keeps its session
            real = pair.prefill.pull_messages

            async def slow(request):
                await asyncio.sleep(1.2)
                async for message in real(request):
                    yield message
            pair.prefill.pull_messages = slow
            grant = await peer.prefill("slow", [4] * 130)
            with await pull_into(pair.d_cache, peer, grant, transport=UCX) as landed:
                assert not procs.landed_differences(pair.decode.pool, landed, "slow", 130)[0]
            pair.prefill.pull_messages = real
            first = peer._session._call
            await until(no_session, "the decode node's own session idled out", 10)
            again = await peer.prefill("again", [5] * 70)
            with await pull_into(pair.d_cache, peer, again, transport=UCX) as landed:
                assert not procs.landed_differences(pair.decode.pool, landed, "again", 70)[0]
            assert peer._session._call is not first
            await freed(pair, start)
    run(main())
