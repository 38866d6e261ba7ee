"""A prefill daemon's drain, as decode nodes see it: on SIGTERM it reports NOT_SERVING, answers new
prefills UNAVAILABLE (so they go to another node), lets a grant it handed out be released, then
exits with every block free."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from connector.config import ConnectorConfig
from connector.decode import DecodeConnector
from connector.errors import TransferError
from connector.wire import Transport
from kpool_pd.launcher import model_flags, start_prefill
from kvcache import BlockAllocator, BlockLayout, CachePool, RingAllocator
from model import ModelConfig
from model.tls import open_channel

MODEL = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=4)
CONFIG = ModelConfig(num_spec=3, num_layers=2, seed=4)
DEADLINE_S = 30.0


async def _health(port: int) -> int:
    async with open_channel(f"127.0.0.1:{port}", None) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


async def _until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not await predicate():
        if loop.time() > deadline:
            pytest.fail(f"{what} did not happen within {DEADLINE_S} s")
        await asyncio.sleep(0.05)


def test_a_draining_prefill_node_is_not_serving_and_answers_unavailable(tmp_path):
    prefill = start_prefill(tmp_path, model_flags(**MODEL), transports="grpc",
                            extra=["--health-port", "0", "--log-format", "text", "--num-blocks", "32"])
    try:
        prefill.wait_ready(90)
        address = f"127.0.0.1:{prefill.port}"

        async def go():
            pool = CachePool(BlockLayout(CONFIG.cache_config()), num_blocks=32, num_rings=4)
            connector = await DecodeConnector(pool, BlockAllocator(32), RingAllocator(4), engine_id="drain-test",
                                              config=ConnectorConfig(), registry=CollectorRegistry(),
                                              transports=(Transport.GRPC_STREAM,)).start()
            try:
                peer = await connector.connect(address)
                grant = await peer.prefill("held", list(range(40)))  # keeps the node draining
                prefill.signal(signal.SIGTERM)
                serving = health_pb2.HealthCheckResponse.SERVING

                async def not_serving() -> bool:
                    ports = (prefill.port, prefill.info["health_port"])
                    return all([await _health(p) != serving for p in ports])
                await _until(not_serving, "NOT_SERVING on both ports")
                with pytest.raises(TransferError) as refused:
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
