"""A prefill daemon's drain, as decode nodes see it: on SIGTERM it reports NOT_SERVING, answers new
prefills UNAVAILABLE (so they go to another node), lets a grant it handed out be released, then
exits with every block free. And a decode daemon whose prefill node restarts on the same address
(with the same engine id, as a StatefulSet pod does) drops the old connection and serves requests
through the new process."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from connector import ConnectorConfig, DecodeConnector, StatusError, Transport, open_channel
from kpool_pd.client import RequestFailed, generate_all
from kpool_pd.launcher import start_decode, start_prefill
from kvcache import BlockAllocator, BlockLayout, CachePool, RingAllocator
from model import ModelConfig
from model.colocated import make_prompts, run_colocated
from runtime import model_flags
from tests.polling import until

MODEL = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=4)
CONFIG = ModelConfig(num_spec=3, num_layers=2, seed=4)
DEADLINE_S = 30.0


async def _health(port: int) -> int:
    async with open_channel(f"127.0.0.1:{port}", None) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


def test_a_draining_prefill_node_is_not_serving_and_answers_unavailable(tmp_path):
    prefill = start_prefill(tmp_path, model_flags(MODEL), transports="grpc",
                            extra=["--health-port", "0", "--log-format", "text", "--num-blocks", "32"])
    try:
        prefill.wait_ready(90)
        address = f"127.0.0.1:{prefill.port}"

        async def go():
            pool = CachePool(BlockLayout(CONFIG.cache_config()), num_blocks=32, num_rings=4)
            connector = await DecodeConnector(pool, BlockAllocator(32), RingAllocator(4), engine_id="drain-test",
                                              config=ConnectorConfig(), registry=CollectorRegistry(),
                                              transports=(Transport.GRPC_STREAM,),
                                              model_identity=CONFIG.identity()).start()
            try:
                peer = await connector.connect(address)
                grant = await peer.prefill("held", list(range(40)))  # keeps the node draining
                prefill.signal(signal.SIGTERM)
                serving = health_pb2.HealthCheckResponse.SERVING

                async def not_serving() -> bool:
                    ports = (prefill.port, prefill.info["health_port"])
                    return all([await _health(p) != serving for p in ports])
                await until(not_serving, "NOT_SERVING on both ports", DEADLINE_S)
                with pytest.raises(StatusError) as refused:
                    await peer.prefill("late", [1, 2, 3])
                assert refused.value.code is grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.message
                landed = await peer.pull(grant)  # a grant handed out before the drain is still served
                landed.release()
                assert prefill.proc.poll() is None or prefill.proc.returncode == 0
            finally:
                await connector.close()
        asyncio.run(go())
        assert prefill.proc.wait(DEADLINE_S) == 0
        assert "free: 32 of 32 blocks" in prefill.log_tail(3)
    finally:
        prefill.stop()


def test_a_prefill_node_restarted_on_the_same_address_is_reconnected(tmp_path):
    flags = model_flags(MODEL)
    extra = ["--log-format", "text", "--engine-id", "prefill-0"]  # a StatefulSet pod keeps its name
    first = start_prefill(tmp_path, flags, name="prefill-first", extra=extra)
    daemons = [first]
    try:
        first.wait_ready(90)
        port = first.port
        decode = start_decode(tmp_path, flags, [f"127.0.0.1:{port}"],
                              extra=["--log-format", "text", "--health-interval-s", "0.3"])
        daemons.append(decode)
        decode.wait_ready(90)
        address = f"127.0.0.1:{decode.port}"
        requests = make_prompts(2, 30, seed=1, vocab_size=CONFIG.vocab_size, max_tokens=6, prefix="before")
        assert not [r for r in asyncio.run(generate_all(address, requests)) if isinstance(r, RequestFailed)]

        first.kill()
        second = start_prefill(tmp_path, flags, name="prefill-second", extra=[*extra, "--port", str(port)])
        daemons.append(second)
        second.wait_ready(90)

        async def reconnected() -> bool:  # a second handshake, with the new process
            return decode.log_tail(400).count("connected to prefill node") >= 2
        asyncio.run(until(reconnected, "a new handshake with the restarted node", DEADLINE_S))
        requests = make_prompts(3, 30, seed=2, vocab_size=CONFIG.vocab_size, max_tokens=6, prefix="after")
        results = asyncio.run(generate_all(address, requests))
        assert not [r for r in results if isinstance(r, RequestFailed)], results
        want = run_colocated(CONFIG, requests)
        assert [(r.output_digest, r.state_digest) for r in results] == \
            [(r.output_digest, r.state_digest) for r in want]
        assert "disconnected from" in decode.log_tail(400)
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
