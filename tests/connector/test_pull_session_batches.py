"""Pulls started together go out in one PullSession message (kpool_pd/connector/decode/pull_session.py,
PullSessionRequest.pulls) to a prefill node that takes batches (HandshakeResponse.pull_batches): each lands
byte for byte as a pull of its own; a pull cancelled before its batch is written never leaves; a node that
does not say it takes batches gets a message a pull."""

from __future__ import annotations

import asyncio

import pytest

from kpool_pd.connector import ConnectorConfig, Transport, ucx_available
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.decode.pull_session import PullSession
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.pulls import pull_into

UCX = Transport.UCX
CONFIG = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


class CountingCall:
    """A PullSession stream whose writes are kept (``written``); the rest goes to ``call`` (None: a stream
    that never answers)."""

    def __init__(self, written: list, call=None) -> None:
        self.written, self.call = written, call
        self._never = asyncio.get_running_loop().create_future()

    async def write(self, message) -> None:
        self.written.append(message)
        if self.call is not None:
            await self.call.write(message)

    async def read(self):
        return await (self.call.read() if self.call is not None else self._never)

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()


def pull(grant_id: str) -> pb.PullRequest:
    return pb.PullRequest(grant_id=grant_id, transport=pb.TRANSPORT_UCX, ucx_tag_base=1)


async def settle() -> None:
    for _ in range(3):  # the batch is written one turn after the opens, the write a turn later
        await asyncio.sleep(0)


@pytest.mark.parametrize("batches", [True, False], ids=["node-takes-batches", "node-without-batches"])
def test_pulls_opened_together_are_one_message_where_the_node_takes_batches(batches):
    async def main():
        written: list = []
        session = PullSession(lambda: CountingCall(written), "prefill:1", batches=batches)
        for grant in ("a", "b", "c"):
            session.open(pull(grant))
        await settle()
        kinds = [m.WhichOneof("message") for m in written]
        if batches:
            assert kinds == ["pulls"] and [p.grant_id for p in written[0].pulls.pulls] == ["a", "b", "c"]
        else:
            assert kinds == ["pull"] * 3 and [m.pull.grant_id for m in written] == ["a", "b", "c"]
        session.open(pull("d"))  # alone in its turn: a message of its own
        await settle()
        assert written[-1].WhichOneof("message") == "pull" and written[-1].pull.grant_id == "d"
        session.close()
    run(main())


def test_a_pull_cancelled_before_its_batch_is_written_never_leaves():
    async def main():
        written: list = []
        session = PullSession(lambda: CountingCall(written), "prefill:1", batches=True)
        kept, dropped = session.open(pull("kept")), session.open(pull("dropped"))
        dropped.cancel()
        await settle()
        assert [m.WhichOneof("message") for m in written] == ["pull"] and written[0].pull.grant_id == "kept"
        kept.cancel()  # written: the node is told
        await settle()
        assert written[-1].WhichOneof("message") == "cancel_grant_id" and written[-1].cancel_grant_id == "kept"
        session.close()
    run(main())


@pytest.mark.skipif(not ucx_available(), reason="the pull session carries UCX pulls; ucxx is not installed")
def test_pulls_started_together_land_byte_for_byte_from_one_message():
    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            session = peer._session
            assert session is not None and session.batches, "the prefill node does not say it takes batches"
            written: list = []
            real_open = session._open_stream
            session._open_stream = lambda: CountingCall(written, real_open())
            grants = [await peer.prefill(f"b{i}", [i + 1] * n) for i, n in enumerate((1, 64, 65, 300))]
            landed = await asyncio.gather(*(pull_into(pair.d_cache, peer, g, transport=UCX) for g in grants))
            for grant, request in zip(grants, landed):
                with request:
                    differences, compared = procs.landed_differences(pair.decode.pool, request, grant.request_id,
                                                                     grant.prompt_len)
                    assert not differences and compared > 0
            pulled = [p.grant_id for m in written if m.WhichOneof("message") == "pulls" for p in m.pulls.pulls]
            assert len(written) == 1 and sorted(pulled) == sorted(g.grant_id for g in grants), \
                f"{len(written)} messages for {len(grants)} pulls started together"

            async def back() -> bool:
                return pair.free() == start
            await until(back, "every block and ring free again on both sides", 10)
    run(main())
