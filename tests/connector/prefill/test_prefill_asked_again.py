"""A decode engine that asks again for a request whose grant it already holds never got the first
answer (its call ended at its deadline on a loaded node just as the grant was made; seen in CI as
ALREADY_EXISTS failing a DCP request). The prefill node releases the earlier grant, frees its blocks and
serves the new call; another engine's request of the same id is left alone."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kpool_pd.connector import ConnectorConfig, StatusError, Transport
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.polling import until
from tests.support.pulls import pull_into

CONFIG = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5), lease_s=30.0)
PROMPT = [3 + i % 50 for i in range(40)]


def test_a_request_asked_again_by_its_engine_gets_a_new_grant_and_the_lost_one_is_freed():
    async def main():
        async with InProcessPair(config=CONFIG, transports=(Transport.GRPC_STREAM,)) as pair:
            start = pair.p_cache.free_blocks, pair.p_cache.free_rings
            peer = await pair.decode.connect(pair.address)
            lost = await peer.prefill("again", PROMPT)  # its answer, as if it never reached the engine
            held = start[0] - pair.p_cache.free_blocks
            assert held > 0
            grant = await peer.prefill("again", PROMPT)
            assert grant.grant_id != lost.grant_id
            assert start[0] - pair.p_cache.free_blocks == held  # the lost grant's blocks went back
            with pytest.raises(StatusError) as refused:
                await pull_into(pair.d_cache, peer, lost, transport=Transport.GRPC_STREAM)
            assert refused.value.code is grpc.StatusCode.NOT_FOUND
            with await pull_into(pair.d_cache, peer, grant, transport=Transport.GRPC_STREAM) as pulled:
                assert pulled.grant.grant_id == grant.grant_id and pulled.nbytes > 0
            await peer.release(grant.grant_id)
            async def freed() -> bool:
                return (pair.p_cache.free_blocks, pair.p_cache.free_rings) == start
            await until(freed, "the prefill node's blocks and rings freed", 10.0)
    asyncio.run(asyncio.wait_for(main(), 60))
