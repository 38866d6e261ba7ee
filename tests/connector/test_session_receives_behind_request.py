"""A UCX pull on a pull session posts its receives once gRPC has its request (kpool_pd/connector/decode/inbound.py,
pull_session.py), so that posting them overlaps the request's way to the prefill node: the bytes still land byte
for byte, and a session that ends before the request was handed on fails the pull with UNAVAILABLE, its receives
retired and everything freed."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kpool_pd.connector import ConnectorConfig, StatusError, Transport, ucx_available
from kpool_pd.connector.decode.pull_session import PullSession
from kpool_pd.connector.shared import hops
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


def test_the_receives_are_posted_once_grpc_has_the_request_and_the_bytes_land_byte_for_byte():
    async def main():
        recorder = hops.HopRecorder().install()
        try:
            async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
                start = pair.free()
                peer = await pair.decode.connect(pair.address)
                handed_at_post: list[bool] = []
                real_post = pair.decode.ucx.post_receives

                def post(views, tag_base):
                    session_pulls = list(peer._session._pulls.values())
                    handed_at_post.append(all(p.handed.done() for p in session_pulls) and bool(session_pulls))
                    return real_post(views, tag_base)
                pair.decode.ucx.post_receives = post
                grants = [await peer.prefill(f"b{i}", [i + 2] * n) for i, n in enumerate((1, 65, 300))]
                for grant in grants:
                    with await pull_into(pair.d_cache, peer, grant, transport=UCX) as landed:
                        differences, compared = procs.landed_differences(pair.decode.pool, landed, grant.request_id,
                                                                         grant.prompt_len)
                        assert not differences and compared > 0, differences[:5]
                assert handed_at_post == [True] * len(grants), "a pull posted its receives before gRPC had its request"
                for grant in grants:
                    stamps = recorder.stamps[grant.grant_id]
                    assert stamps["request"] <= stamps["posted"] <= stamps["landed"]

                async def back() -> bool:
                    return pair.free() == start
                await until(back, "every block and ring free again on both sides", 10)
        finally:
            recorder.uninstall()
    run(main())


def test_a_session_that_ends_before_its_request_is_handed_on_fails_the_pull_and_frees_everything():
    async def main():
        async with InProcessPair(config=CONFIG, transports=(UCX,)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("never-sent", [5] * 130)
            never = asyncio.Event()

            async def stuck_writer(self, call, outgoing):  # takes the request and never gives it to gRPC
                await outgoing.get()
                await never.wait()
            real_write = PullSession._write
            PullSession._write = stuck_writer
            try:
                allocation = allocation_for(pair.d_cache, grant)
                pull = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=UCX, release=False))

                async def opened() -> bool:
                    return peer._session is not None and grant.grant_id in peer._session._pulls
                await until(opened, "the pull to be opened on the session", 10)
                session_pull = peer._session._pulls[grant.grant_id]
                await asyncio.sleep(0)
                assert not session_pull.handed.done() and not pull.done()  # it waits for its request to go
                peer._session.close()
                with pytest.raises(StatusError) as failed:
                    await asyncio.wait_for(pull, patient(10))
                assert failed.value.code is grpc.StatusCode.UNAVAILABLE and "session ended" in failed.value.message
                assert pair.decode_sample("transfer_failures_total", cause="ucx_receive_abandoned") == 0
                allocation.release()
            finally:
                PullSession._write = real_write
            await peer.release(grant.grant_id)
            with await pull_into(pair.d_cache, peer, await peer.prefill("after", [6] * 70), transport=UCX) as landed:
                assert not procs.landed_differences(pair.decode.pool, landed, "after", 70)[0]  # the next session serves

            async def back() -> bool:
                return pair.free() == start
            await until(back, "every block and ring free again on both sides", 10)
    run(main())
