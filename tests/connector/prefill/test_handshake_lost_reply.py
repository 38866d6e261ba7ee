"""A Handshake whose reply is lost cannot lock its engine out: the prefill node admits the engine, the reply
comes after the decode engine gave up (its deadline), and the engine's next Handshake (the same secret, drawn
before the first) is admitted as the same engine and pulls; an impostor naming that engine id is still
refused."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, PrefillConnector, StatusError, Transport
from kpool_pd.kvcache import EngineCache
from tests.support.serving import serve_prefill, stop_prefill
from tests.connector.prefill.test_connector_offer import BLOCK_SIZE, NoPrefillCalls, block_bytes, grant_of, planes

TOKEN = "lost-reply-token"
FIRST_DEADLINE_S = 1.0  # the decode engine's first Handshake gives up this soon
DEADLINE_S = 60.0  # everything else, on a loaded machine


def test_a_handshake_retried_after_its_lost_reply_is_the_same_engine():
    async def main():
        config = ConnectorConfig(peer_token=TOKEN, rpc_timeout_s=DEADLINE_S, transfer_timeout_s=DEADLINE_S)
        prefill_cache = EngineCache(planes(seed=3))
        prefill = PrefillConnector(prefill_cache.pool, NoPrefillCalls(), engine_id="prefill-l", config=config,
                                   registry=CollectorRegistry(), transports=(Transport.GRPC_STREAM,))
        answered_first = asyncio.Event()
        gave_up = asyncio.Event()
        real_answer = prefill.handshakes.answer

        async def reply_late_once(request, context):
            response = await real_answer(request, context)  # the engine is admitted here
            if not answered_first.is_set():
                answered_first.set()
                await asyncio.wait_for(gave_up.wait(), DEADLINE_S)  # the reply leaves after the caller left
            return response
        prefill.handshakes.answer = reply_late_once
        server = await serve_prefill(prefill)
        address = f"127.0.0.1:{server.port}"
        decode_cache = EngineCache(planes(seed=None))
        decode = DecodeConnector(decode_cache.pool, engine_id="decode-l", registry=CollectorRegistry(),
                                 config=dataclasses.replace(config, rpc_timeout_s=FIRST_DEADLINE_S),
                                 transports=(Transport.GRPC_STREAM,))
        impostor = DecodeConnector(EngineCache(planes(seed=None)).pool, engine_id="decode-l", config=config,
                                   registry=CollectorRegistry(), transports=(Transport.GRPC_STREAM,))
        try:
            await decode.start()
            with pytest.raises(StatusError) as first:
                await decode.connect(address)
            assert first.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            assert answered_first.is_set(), "the prefill node never admitted the first Handshake"
            gave_up.set()
            await asyncio.wait_for(_admitted(prefill, "decode-l"), DEADLINE_S)

            decode.config = config  # the retry may take as long as a loaded machine needs
            peer = await decode.connect(address)
            src, dst = (2, 3), (7, 8)
            allocation = prefill_cache.lend("req-l", src, on_release=lambda: None)
            grant_id = secrets.token_hex(16)
            prefill.offer(allocation, grant_id=grant_id, request_id="req-l", prompt_len=2 * BLOCK_SIZE)
            with decode_cache.lend("req-l", dst, on_release=lambda: None) as into:
                await peer.pull(grant_of(grant_id, "req-l", src, 2 * BLOCK_SIZE), into=into,
                                transport=Transport.GRPC_STREAM)
            for s, d in zip(src, dst):
                assert all(torch.equal(a, b) for a, b in zip(block_bytes(decode_cache.pool, d),
                                                             block_bytes(prefill_cache.pool, s)))

            await impostor.start()
            with pytest.raises(StatusError) as refused:
                await impostor.connect(address)
            assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
        finally:
            await impostor.close()
            await decode.close()
            await stop_prefill(server, prefill)
    asyncio.run(main())


async def _admitted(prefill: PrefillConnector, engine_id: str) -> None:
    while prefill.handshakes.engines.get(engine_id) is None:
        await asyncio.sleep(0.02)
