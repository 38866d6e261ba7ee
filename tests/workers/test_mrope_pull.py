"""The packed MRoPE positions in the decode node's ring after a PD transfer: an image prompt submitted to the decode
scheduler with its positions is prefilled by a prefill node (connector and batching engine, 16-token steps: chunk
boundaries inside the image and inside groups) and pulled into the scheduler's allocation; the decode node's ring then
holds the prompt's open group (what a transfer moves of the ring: an image's last tokens and the text after it), each
position packed as the seed packs it (computed independently, ``tests/model/test_mrope_positions.py``), before its first step
and, with the generated tokens', after its last; and the request equals its colocated run byte for byte."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, PrefillConnector, Transport
from kpool_pd.decode_worker.fetch import OneNode, PullChoice
from kpool_pd.decode_worker.jobs import Finished, Tokens
from kpool_pd.decode_worker.router import PrefillRouter
from kpool_pd.decode_worker.scheduler import DecodeScheduler
from kpool_pd.kvcache import NodeCache
from kpool_pd.model import Engine
from kpool_pd.model.colocated import run_colocated
from kpool_pd.prefill_worker.batcher import BatchingPrefillEngine
from tests.support.deadlines import patient
from tests.support.mrope_prompts import image_requests
from tests.support.serving import serve_prefill, stop_prefill
from tests.model.test_mrope_positions import QSA, check_ring_positions

GRPC = Transport.GRPC_STREAM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def pulled_and_decoded(request) -> tuple[list, list]:
    """The request through a prefill node and a decode scheduler on loopback: the ring checked after the pull and
    after the last step; returns the tokens and the finished event."""
    config = ConnectorConfig(rpc_timeout_s=patient(10), transfer_timeout_s=patient(10))
    p_cache = NodeCache(QSA.cache, num_blocks=8, num_rings=2)
    batcher = BatchingPrefillEngine(Engine(QSA, p_cache.pool), p_cache, max_batch_tokens=16, max_queue=4,
                                    registry=CollectorRegistry())
    prefill = PrefillConnector(p_cache.pool, batcher, engine_id="prefill-m", config=config,
                               registry=CollectorRegistry(), transports=(GRPC,))
    batch_loop = asyncio.create_task(batcher.run())
    server = await serve_prefill(prefill)
    d_cache = NodeCache(QSA.cache, num_blocks=8, num_rings=2)
    decode = await DecodeConnector(d_cache.pool, engine_id="decode-m", config=config, registry=CollectorRegistry(),
                                   transports=(GRPC,)).start()
    router = PrefillRouter(decode, (f"127.0.0.1:{server.port}",), health_interval_s=60, rpc_timeout_s=patient(10))
    await router.start()
    engine = Engine(QSA, d_cache.pool)
    fetch = OneNode(QSA.cache, PullChoice(transport=GRPC, integrity=True, rpc_timeout_s=patient(10)), pipelined=True)
    scheduler = DecodeScheduler(engine, d_cache, decode, router, fetch=fetch, max_running=2, max_queue=4,
                                queue_timeout_s=10.0, registry=CollectorRegistry())
    decode_loop = asyncio.create_task(scheduler.run())
    try:
        job = scheduler.submit(request.request_id, request.prompt, request.max_tokens,
                               mrope_positions=request.mrope_positions)
        await scheduler.wait_admitted(job)
        await scheduler.fetch(job)
        prompts = [(len(request.prompt), request.mrope_positions)]
        check_ring_positions(engine, [job.seq], prompts, pulled=True)  # the pulled ring, before any step
        scheduler.first_token_sent(job)
        scheduler.start_decoding(job)
        tokens, events = list(job.seq.output[:1]), []
        while not events or not isinstance(events[-1], Finished):
            events.append(await asyncio.wait_for(job.events.get(), 60))
            if isinstance(events[-1], Tokens):
                tokens += events[-1].token_ids
        check_ring_positions(engine, [job.seq], prompts, pulled=True)  # after the last step
        scheduler.abandon(job, "ok")
        return tokens, events
    finally:
        for task in (decode_loop, batch_loop):
            task.cancel()
        await asyncio.gather(decode_loop, batch_loop, return_exceptions=True)
        scheduler.close()
        await router.close()
        await decode.close()
        await stop_prefill(server, prefill)


def test_a_pulled_image_prompt_holds_its_packed_positions_and_equals_colocated():
    request, = image_requests([(47, (35, 2, 6), 11)], vocab_size=QSA.vocab_size, seed=9)
    tokens, events = asyncio.run(asyncio.wait_for(pulled_and_decoded(request), 120))
    reference, = run_colocated(QSA, [request])
    finished = events[-1]
    assert tuple(tokens) == reference.tokens
    assert (finished.output_digest, finished.state_digest) == (reference.output_digest, reference.state_digest)
