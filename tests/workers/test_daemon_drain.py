"""A prefill daemon's drain, as decode nodes see it: on SIGTERM it reports NOT_SERVING, answers new
prefills UNAVAILABLE (so they go to another node), lets a grant it handed out be released, then
exits with every block free. A decode daemon whose prefill node restarts on the same address
(with the same engine id) drops the old connection and serves requests through the new process.
And a decode daemon rolled away under load (SIGTERM while a client balances over two decode
daemons, as one resolving the headless Service does) finishes every request it admitted, and its
GOAWAY moves the client's new requests to the other daemon at once."""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, StatusError, Transport, open_channel
from kpool_pd.decode_worker import api
from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.runtime.launch import start_decode, start_prefill
from kpool_pd.kvcache import NodeCache
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import make_prompts, run_colocated
from kpool_pd.runtime import LIVENESS_SERVICE, GrpcServer, model_flags
from tests.support.ports import free_port
from tests.support.polling import until

MODEL = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=4)
CONFIG = ModelConfig.build(num_spec=3, num_layers=2, seed=4)
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
            cache = NodeCache(CONFIG.cache, num_blocks=32, num_rings=4)
            connector = await DecodeConnector(cache.pool, engine_id="drain-test",
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
                with cache.allocate("held", cache.config.blocks_for_tokens(grant.prompt_len)) as allocation:
                    await peer.pull(grant, into=allocation)  # a grant handed out before the drain is still served
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


def test_refusing_new_calls_closes_the_main_port_and_keeps_the_health_port():
    async def main():
        server = GrpcServer()
        port = await server.start("127.0.0.1", 0, health_port=0)
        await server.set_serving(True)
        assert await _health(port) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(ValueError, match="grace"):
            await server.refuse_new_calls(-1)
        await server.refuse_new_calls(30)
        await server.refuse_new_calls(30)  # idempotent
        assert server.refusing
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _health(port)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        await server.set_serving(False)  # what a drain reports, on the health port that probes ask
        assert await _health(server.health_port) == health_pb2.HealthCheckResponse.NOT_SERVING
        async with open_channel(f"127.0.0.1:{server.health_port}", None) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        loop = asyncio.get_running_loop()
        started = loop.time()
        await server.stop(0.2)  # cuts the 30 s grace short
        assert loop.time() - started < 5
    asyncio.run(main())


LONG_TOKENS = 160  # the request in flight on the rolled daemon: it keeps that daemon draining for a second or two
LOAD_WORKERS = 4


def _gauge(metrics_port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, flags=re.M)
    assert found, f"{name} is not exported"
    return float(found.group(1))


async def _generate(stub, request, events: list[str]) -> tuple[str, tuple]:
    """One request; ``events`` gets "started" once the node admitted it (its first reply). Returns
    ("ok", digests) or the failure's code name and details."""
    call = stub.Generate(api.GenerateRequest(request_id=request.request_id, prompt_token_ids=list(request.prompt),
                                             max_tokens=request.max_tokens), timeout=120)
    tokens: list[int] = []
    try:
        async for reply in call:
            kind = reply.WhichOneof("event")
            if kind == "started":
                events.append("started")
            elif kind == "tokens":
                tokens.extend(reply.tokens.token_ids)
            elif kind == "finished":
                return "ok", (tuple(tokens), reply.finished.output_digest, reply.finished.state_digest)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, (exc.details() or "",)
    return "INTERNAL", ("stream ended without finished",)


def test_a_decode_node_rolled_under_load_finishes_what_it_admitted_and_sends_clients_elsewhere(tmp_path):
    flags = model_flags(MODEL)
    prefill_port = free_port()  # known up front, so that the three daemons start (and warm up) at once
    prefill = start_prefill(tmp_path, flags, transports="grpc", extra=["--log-format", "text", "--port",
                                                                       str(prefill_port)])
    daemons = [prefill]
    try:
        decode_flags = ["--log-format", "text", "--health-interval-s", "0.3", "--max-new-tokens", str(LONG_TOKENS)]
        rolled, kept = (start_decode(tmp_path, flags, [f"127.0.0.1:{prefill_port}"], name=name, transport="grpc",
                                     extra=decode_flags) for name in ("decode-rolled", "decode-kept"))
        daemons += [rolled, kept]
        for daemon in daemons:
            daemon.wait_ready(90)
        long = make_prompts(1, 21, seed=8, vocab_size=CONFIG.vocab_size, max_tokens=LONG_TOKENS, prefix="long")[0]
        load = make_prompts(40, 30, seed=9, vocab_size=CONFIG.vocab_size, max_tokens=12, prefix="load")

        async def go():
            # The client balances over both daemons as one resolving the headless Service does.
            target = f"ipv4:127.0.0.1:{rolled.port},127.0.0.1:{kept.port}"
            refusals: list[tuple[str, str]] = []
            lost: list[tuple[str, str, tuple]] = []
            results: dict[str, tuple] = {}
            pending = list(load)
            signalled = asyncio.Event()

            async with grpc.aio.insecure_channel(target, options=[("grpc.lb_policy_name", "round_robin")]) as channel, \
                    open_channel(f"127.0.0.1:{rolled.port}", None) as direct:
                await until(lambda: _ready(channel), "the balanced channel connected", DEADLINE_S)
                stub = api.GenerateServiceStub(channel)

                async def worker():
                    while pending:
                        request = pending.pop(0)
                        events: list[str] = []
                        outcome, detail = await _generate(stub, request, events)
                        if outcome == "ok":
                            results[request.request_id] = detail
                        elif events:  # admitted, then failed: a lost request
                            lost.append((request.request_id, outcome, detail))
                        else:  # refused before admission: a client retries it
                            refusals.append((outcome, detail[0]))
                            pending.append(request)
                            await asyncio.sleep(0.02)
                        if len(results) >= 4 and not signalled.is_set():
                            await signalled.wait()

                workers = [asyncio.ensure_future(worker()) for _ in range(LOAD_WORKERS)]
                await until(lambda: _true(len(results) >= 4), "load on both daemons", DEADLINE_S)
                # the long request starts once the load is on, and the signal follows its admission at once: it
                # decodes for a second or more, so it is in flight when the daemon is told to stop (were it
                # started with the load, it could finish before the load's first results on a loaded machine)
                long_events: list[str] = []
                long_call = asyncio.ensure_future(_generate(api.GenerateServiceStub(direct), long, long_events))
                await until(lambda: _true(long_events == ["started"]), "the long request admitted", DEADLINE_S,
                            period_s=0.005)
                # its first reply goes out before it joins the decode batch: wait for that, as a loaded machine
                # may take a while between the two
                await until(lambda: _true(_gauge(rolled.metrics_port, "kpoolpd_decode_running") >= 1),
                            "the long request in the rolled daemon's decode batch", DEADLINE_S, period_s=0.005)
                assert not long_call.done()
                rolled.signal(signal.SIGTERM)  # what the kubelet sends once the preStop hook is done
                draining_since = time.monotonic()
                signalled.set()
                await asyncio.gather(*workers)
                load_done_s = time.monotonic() - draining_since
                outcome, detail = await long_call
                return refusals, lost, results, (outcome, detail), load_done_s

        refusals, lost, results, long_result, load_done_s = asyncio.run(go())
        assert rolled.proc.wait(DEADLINE_S) == 0, rolled.log_tail()
        assert not lost, lost
        assert long_result[0] == "ok", long_result  # in flight on the rolled daemon when it got SIGTERM
        # GOAWAY: the client stopped sending to the draining daemon at once; without it every other
        # request would be refused for as long as the long request kept that daemon draining.
        assert len(refusals) <= LOAD_WORKERS, refusals
        assert load_done_s < 30, load_done_s
        want = run_colocated(CONFIG, [long, *load])
        assert long_result[1] == (want[0].tokens, want[0].output_digest, want[0].state_digest)
        assert {r.request_id: (r.tokens, r.output_digest, r.state_digest) for r in want[1:]} == results
        assert re.search(r"decode node stopped; free: (\d+) of \1 blocks", rolled.log_tail(5)), rolled.log_tail(5)
        assert "takes no new calls (GOAWAY sent)" in rolled.log_tail(400)
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


async def _ready(channel: grpc.aio.Channel) -> bool:
    return channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY


async def _true(value: bool) -> bool:
    return value
