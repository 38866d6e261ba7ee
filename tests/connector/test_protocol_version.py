"""The connector protocol's version in the Handshake: both sides state the version they speak, and a peer of
another one (an older one states none) is refused FAILED_PRECONDITION by name, with nothing kept. Version 2
moved the pull's plan into the PullRequest, which an older peer neither sends nor serves."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kpool_pd.connector import StatusError
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.channels import open_channel
from kpool_pd.connector.shared.wire import PROTOCOL_VERSION, layout_message
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


def test_the_version_is_the_plan_carrying_one():
    assert PROTOCOL_VERSION == 2


@pytest.mark.parametrize("version", [0, 1, PROTOCOL_VERSION + 1], ids=["unstated", "one", "newer"])
def test_a_decode_node_of_another_version_is_refused_by_name_and_not_admitted(version):
    async def main():
        async with InProcessPair() as pair:
            async with open_channel(pair.address, None, peer_token=procs.TOKEN, challenge_timeout_s=5.0) as channel:
                stub = pb.PrefillServiceStub(channel)
                request = pb.HandshakeRequest(engine_id="decode-old", layout=layout_message(pair.d_cache.pool.layout),
                                              transports=[pb.TRANSPORT_GRPC_STREAM], protocol_version=version)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Handshake(request, timeout=5)
                assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                spoken = f"connector protocol {version}" if version else \
                    "a connector protocol older than 2 (it states no version)"
                assert f"engine decode-old speaks {spoken}; prefill node prefill-t speaks connector protocol " \
                       f"{PROTOCOL_VERSION}" in err.value.details()
                assert pair.prefill_sample("transfer_failures_total", cause="protocol_mismatch") == 1
                with pytest.raises(grpc.aio.AioRpcError) as err:  # nothing was admitted under its id
                    await stub.Prefill(pb.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                                         engine_id="decode-old"), timeout=5)
                assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert "has not handshaken" in err.value.details()
            peer = await pair.decode.connect(pair.address)  # a node of this version is served as before
            assert peer.engine_id == "prefill-t"
    run(main())


def test_a_prefill_node_that_states_no_version_is_refused_by_name_and_no_peer_is_kept():
    async def main():
        pair = InProcessPair()
        real = pair.prefill.Handshake

        async def older(request, context):  # a node before versions: its answer states none
            response = await real(request, context)
            response.ClearField("protocol_version")
            return response
        pair.prefill.Handshake = older  # before the server registers the servicer
        async with pair:
            with pytest.raises(StatusError) as err:
                await pair.decode.connect(pair.address)
            assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
            assert f"Handshake with {pair.address}: prefill node prefill-t speaks a connector protocol older than 2 " \
                   f"(it states no version); " \
                   f"this engine speaks connector protocol {PROTOCOL_VERSION}" in err.value.message
            assert pair.decode.peers == ()
            assert pair.decode_sample("transfer_failures_total", cause="protocol_mismatch") == 1
    run(main())
