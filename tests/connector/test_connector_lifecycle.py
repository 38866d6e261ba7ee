"""The connector's lifecycle edges in one process: a Prefill cancelled by its caller frees its
allocation, an engine that is unavailable is answered UNAVAILABLE, the health status follows
set_serving, and a decode node disconnects from a node (UCX endpoint included) to handshake
again with its restarted successor."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kpool_pd.connector import (ConnectorConfig, EngineUnavailable, PrefillConnector, PrefillInput, PrefillOutput,
                       PrefillProgress, StatusError, Transport)
from kpool_pd.kvcache import NodeCache
from kpool_pd.runtime import LIVENESS_SERVICE
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support import polling
from tests.support.deadlines import patient
from tests.support.pulls import allocation_for, pull_into
from tests.support.serving import serve_prefill, stop_prefill

GRPC = Transport.GRPC_STREAM
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


async def until(condition, timeout_s: float = 5.0) -> bool:
    """Wait for ``condition()`` to hold, at most ``timeout_s``; returns whether it held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition() and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return condition()


def serve_the_prompt(cache: NodeCache, request: PrefillInput, progress: PrefillProgress) -> None:
    """Allocate the prompt's blocks and a ring in ``cache`` and hand them to the call (the grant's from now on)."""
    blocks = cache.config.blocks_for_tokens(len(request.prompt_token_ids))
    progress.serve_from(cache.allocate(request.request_id, blocks))


class StalledEngine:
    """Allocates (from ``cache``, the prefill node's: ``InProcessPair`` sets it), then waits (at most
    ``stall_s``) for a release that never comes; records being cancelled."""

    def __init__(self, stall_s: float = 30.0) -> None:
        self.stall_s = stall_s
        self.cache: NodeCache | None = None
        self.allocated = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def prefill(self, request: PrefillInput, progress: PrefillProgress) -> PrefillOutput:
        serve_the_prompt(self.cache, request, progress)
        self.allocated.set()
        try:
            await asyncio.wait_for(asyncio.Event().wait(), self.stall_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise RuntimeError(f"the test engine stalled for {self.stall_s} s without being cancelled")


class UnavailableEngine:
    """Allocates and serves from it, then finds that it cannot run (as a draining or broken engine would)."""

    def __init__(self) -> None:
        self.cache: NodeCache | None = None  # the prefill node's (``InProcessPair`` sets it)

    async def prefill(self, request: PrefillInput, progress: PrefillProgress) -> PrefillOutput:
        serve_the_prompt(self.cache, request, progress)
        raise EngineUnavailable("draining for shutdown")


# 1. cancellation -----------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["client-deadline", "client-cancels"])
def test_cancelled_prefill_frees_its_allocation(how):
    async def main():
        engine = StalledEngine()
        config = ConnectorConfig(peer_token=procs.TOKEN, rpc_timeout_s=5.0 if how == "client-cancels" else 0.5)
        async with InProcessPair(engine=engine, config=config) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            call = asyncio.ensure_future(peer.prefill("slow", [1] * 300))  # 5 blocks and a ring
            assert await asyncio.wait_for(engine.allocated.wait(), 5)
            assert pair.free()[:2] == (start[0] - 5, start[1] - 1)
            if how == "client-cancels":
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            else:
                with pytest.raises(StatusError) as err:
                    await call
                assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(engine.cancelled.wait(), 5)
            assert await until(lambda: pair.free() == start), pair.free()
            assert len(pair.prefill.leases) == 0
            assert await until(lambda: pair.prefill_sample("transfer_failures_total", cause="cancelled") == 1)
    run(main())


# 2. an unavailable engine and the health status ---------------------------------------------
def test_engine_unavailable_is_answered_unavailable_and_frees():
    async def main():
        async with InProcessPair(engine=UnavailableEngine()) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            with pytest.raises(StatusError) as err:
                await peer.prefill("refused", [1] * 100)
            assert err.value.code is grpc.StatusCode.UNAVAILABLE
            assert "prefill node prefill-t: draining for shutdown" in err.value.message
            # the status reaches the caller as the handler aborts; its cleanup follows at once
            assert await until(lambda: pair.free() == start and pair.prefill_sample(
                "transfer_failures_total", cause="engine_unavailable") == 1)
    run(main())


async def _health(address: str) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return [(await stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=5)).status
                for s in ("", PrefillConnector.service_name)]


def test_set_serving_flips_the_health_of_the_service_and_the_server():
    async def main():
        async with InProcessPair() as pair:
            assert await _health(pair.address) == [SERVING, SERVING]
            await pair.server.set_serving(False)
            assert await _health(pair.address) == [NOT_SERVING, NOT_SERVING]
            await pair.server.set_serving(False)  # idempotent
            assert await _health(pair.address) == [NOT_SERVING, NOT_SERVING]
            peer = await pair.decode.connect(pair.address)  # NOT_SERVING refuses nothing by itself
            grant = await peer.prefill("still-served", [1] * 10)
            assert await peer.release(grant.grant_id) is True
            await pair.server.set_serving(True)
            assert await _health(pair.address) == [SERVING, SERVING]
            with pytest.raises(TypeError):
                await pair.server.set_serving("no")
    run(main())


def test_the_health_gate_is_the_one_serving_state_the_server_reports():
    """The server keeps no serving flag: what its gate decides (able, draining) is what health reports."""
    async def main():
        async with InProcessPair() as pair:
            server, gate = pair.server, pair.server.health
            assert server.serving and gate.serving and await _health(pair.address) == [SERVING, SERVING]
            gate.set_able(False, "no room for a request")
            assert not server.serving
            await polling.until(lambda: _health_is(pair.address, NOT_SERVING), "NOT_SERVING once the node cannot serve", 10)
            gate.set_able(True)
            await polling.until(lambda: _health_is(pair.address, SERVING), "SERVING again once it can", 10)
            await gate.drain()
            gate.set_able(True)  # able, but draining
            assert not server.serving and await _health(pair.address) == [NOT_SERVING, NOT_SERVING]
    run(main())


async def _health_is(address: str, status: int) -> bool:
    return await _health(address) == [status, status]


def test_a_server_starts_reporting_what_its_health_gate_says():
    async def main():
        pair = InProcessPair()
        server = await serve_prefill(pair.prefill, serving=False)  # the gate stays closed
        assert not server.serving and not server.health.serving
        try:
            address = f"127.0.0.1:{server.port}"
            assert await _health(address) == [NOT_SERVING, NOT_SERVING]
            await server.set_serving(True)
            assert await _health(address) == [SERVING, SERVING]
        finally:
            await stop_prefill(server, pair.prefill)
        assert await _health_or_code(address) is grpc.StatusCode.UNAVAILABLE  # stopped: nothing answers
    run(main())


def test_the_liveness_name_stays_serving_while_the_server_is_not_serving():
    async def liveness(address: str) -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=5)
        return reply.status

    async def main():
        pair = InProcessPair()
        server = await serve_prefill(pair.prefill, serving=False)
        try:
            address = f"127.0.0.1:{server.port}"
            assert await _health(address) == [NOT_SERVING, NOT_SERVING]
            assert await liveness(address) == SERVING  # up, though not taking requests
            await server.set_serving(True)
            await server.set_serving(False)  # a drain, a node without peers
            assert await liveness(address) == SERVING
        finally:
            await stop_prefill(server, pair.prefill)
    run(main())


async def _health_or_code(address: str):
    try:
        return await _health(address)
    except grpc.aio.AioRpcError as exc:
        return exc.code()


# 3. disconnect and handshake again with a restarted node --------------------------------------
@pytest.mark.parametrize("transport", [GRPC, Transport.UCX], ids=["grpc", "ucx"])
def test_disconnect_then_handshake_with_a_restarted_node(transport):
    async def main():
        async with InProcessPair(transports=(transport,)) as pair:
            start = pair.free()
            first = await pair.decode.connect(pair.address)
            second = await pair.decode.connect(pair.address)  # e.g. a router that handshook twice
            assert pair.decode.peers == (first, second)
            if transport is Transport.UCX:  # the prefill node reached our worker during the Handshake
                assert pair.prefill.engines.get(pair.decode.engine_id).reaches_over(Transport.UCX)
            assert await pair.decode.disconnect(first) == 1
            assert pair.decode.peers == (second,) and first.closed and not second.closed
            grant = await second.prefill("on-the-other-peer", [3] * 70)  # the other peer still pulls
            with await pull_into(pair.d_cache, second, grant, transport=transport, integrity=True) as landed:
                assert landed.nbytes > 0
            assert await pair.decode.disconnect(pair.address) == 1
            assert pair.decode.peers == () and second.closed
            assert await pair.decode.disconnect(pair.address) == 0  # idempotent
            assert await pair.decode.disconnect(first) == 0
            with pytest.raises(TypeError):
                await pair.decode.disconnect(42)

            # the node restarts on the same port as a new process would: new engine, new UCX worker
            port = int(pair.address.rsplit(":", 1)[1])
            await stop_prefill(pair.server, pair.prefill)
            pair.prefill = PrefillConnector(pair.p_cache.pool, procs.SeededFillEngine(pair.p_cache),
                                            engine_id="prefill-restarted", config=pair.prefill.config,
                                            registry=CollectorRegistry(), transports=(transport,))
            pair.server = await serve_prefill(pair.prefill, port=port)
            assert pair.server.port == port
            peer = await pair.decode.connect(pair.address)
            assert peer.engine_id == "prefill-restarted" and pair.decode.peers == (peer,)
            grant = await peer.prefill("after-restart", [4] * 130)
            with await pull_into(pair.d_cache, peer, grant, transport=transport, integrity=True) as landed:
                assert landed.nbytes > 0
            assert pair.free() == start
    run(main())


def test_pull_on_a_disconnected_peer_fails_and_leaves_the_allocation_to_the_caller():
    async def main():
        async with InProcessPair(config=dataclasses.replace(
                ConnectorConfig(peer_token=procs.TOKEN), rpc_timeout_s=3.0, transfer_timeout_s=3.0)) as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("orphan", [2] * 100)
            await pair.decode.disconnect(peer)
            allocation = allocation_for(pair.d_cache, grant)
            with pytest.raises(StatusError) as err:
                await peer.pull(grant, into=allocation, transport=GRPC)
            assert err.value.code is grpc.StatusCode.UNAVAILABLE and "was disconnected" in err.value.message
            assert not allocation.released and pair.free()[2:] == (start[2] - grant.num_blocks, start[3] - 1)
            allocation.release()
            assert pair.free()[2:] == start[2:]
    run(main())
