"""The decode node's prefill router over real prefill servers whose health checks carry a load the test
sets: requests go to the least loaded node, a burst spreads instead of herding, a node's report changes
the choice at the next check, and round robin stays available."""

from __future__ import annotations

import asyncio
import collections

from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, PrefillConnector, Transport
from kpool_pd.decode_worker.prefill_choice import PrefillPolicy
from kpool_pd.decode_worker.router import PrefillRouter
from kpool_pd.kvcache import NodeCache
from kpool_pd.runtime import GrpcServer
from kpool_pd.runtime.load_report import NodeLoad
from tests.support import connector_procs as procs
from tests.support.connector_engines import SeededFillEngine
from tests.support.deadlines import patient

CONFIG = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))


class LoadedPrefill:
    """A prefill connector behind a server whose health answers carry ``self.load``."""

    def __init__(self, name: str) -> None:
        self.cache = NodeCache(procs.CONFIG, num_blocks=32, num_rings=4, device="cpu")
        self.node = PrefillConnector(self.cache.pool, SeededFillEngine(self.cache), engine_id=name, config=CONFIG,
                                     registry=CollectorRegistry(), transports=(Transport.GRPC_STREAM,))
        self.load = NodeLoad(queued_prompt_tokens=0, free_blocks=32, block_tokens=procs.CONFIG.block_size,
                             steps_in_flight=0)
        self.server: GrpcServer | None = None
        self.address = ""

    async def start(self) -> None:
        await self.node.start()
        self.server = GrpcServer(peer_token=CONFIG.peer_token, options=CONFIG.grpc_options(), load=lambda: self.load)
        self.server.add(self.node)
        await self.server.start("127.0.0.1", 0)
        await self.server.health.open(self.server)
        self.address = f"127.0.0.1:{self.server.port}"

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.node.stop()


async def _fleet(count: int, policy: PrefillPolicy, test) -> None:
    nodes = [LoadedPrefill(f"prefill-{i}") for i in range(count)]
    for node in nodes:
        await node.start()
    cache = NodeCache(procs.CONFIG, num_blocks=32, num_rings=4, device="cpu")
    decode = DecodeConnector(cache.pool, engine_id="decode-t", config=CONFIG, registry=CollectorRegistry(),
                             transports=(Transport.GRPC_STREAM,))
    await decode.start()
    registry = CollectorRegistry()
    router = PrefillRouter(decode, tuple(n.address for n in nodes), health_interval_s=60, rpc_timeout_s=patient(5),
                           policy=policy, registry=registry)
    await router.start()
    try:
        await test(nodes, router, registry)
    finally:
        await router.close()
        await decode.close()
        for node in nodes:
            await node.stop()


async def _picks(router: PrefillRouter, count: int, tokens: int) -> collections.Counter:
    return collections.Counter([(await router.pick(tokens)).address for _ in range(count)])


def test_requests_go_to_the_least_loaded_node_and_follow_its_reports():
    async def test(nodes, router, registry):
        nodes[0].load = NodeLoad(queued_prompt_tokens=50_000, free_blocks=32, block_tokens=64, steps_in_flight=1)
        await router.refresh()
        assert router.loads()[nodes[0].address]["queued_tokens"] == 50_000
        assert await _picks(router, 6, 100) == {nodes[1].address: 3, nodes[2].address: 3}

        nodes[0].load = NodeLoad(queued_prompt_tokens=0, free_blocks=32, block_tokens=64, steps_in_flight=0)
        nodes[1].load = nodes[2].load = NodeLoad(queued_prompt_tokens=9_000, free_blocks=32, block_tokens=64,
                                                 steps_in_flight=1)
        await router.refresh()  # its queue drained: the next check says so, and the picks since are covered
        assert await _picks(router, 5, 100) == {nodes[0].address: 5}
        for node in nodes:
            assert registry.get_sample_value("kpoolpd_decode_prefill_picks_total",
                                             {"prefill": node.address}) in (3, 5)
    asyncio.run(_fleet(3, PrefillPolicy.LEAST_LOADED, test))


def test_a_burst_between_two_checks_spreads_over_idle_nodes():
    async def test(nodes, router, registry):
        picks = await _picks(router, 32, 500)
        assert sorted(picks.values()) == [8, 8, 8, 8]
        estimated = {address: view["queued_tokens"] for address, view in router.loads().items()}
        assert estimated == {n.address: 8 * 500 for n in nodes}
    asyncio.run(_fleet(4, PrefillPolicy.LEAST_LOADED, test))


def test_round_robin_stays_available_and_ignores_load():
    async def test(nodes, router, registry):
        nodes[0].load = NodeLoad(queued_prompt_tokens=10**6, free_blocks=0, block_tokens=64, steps_in_flight=1)
        await router.refresh()
        assert await _picks(router, 6, 100) == {nodes[0].address: 3, nodes[1].address: 3}
    asyncio.run(_fleet(2, PrefillPolicy.ROUND_ROBIN, test))
