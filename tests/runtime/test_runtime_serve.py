"""The serve skeleton both daemons share, with a stand-in node: the order of build, warm-up,
start, serving, drain and close; health NOT_SERVING until ready and again while draining; the
ready file, ``/metrics``; a drain that runs out of time; cleanup when a start step fails; and
the entry's exit status 2 for a bad setting."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Gauge

from kpool_pd.connector import Credential, Transport, UcxProgress, open_channel
from kpool_pd.kvcache import CacheConfig, NodeCache
from kpool_pd.runtime import (MODEL_OPTIONS, TLS_OPTIONS, DaemonSpec, NodeContext, Role, Transports, load_settings, run_daemon, serve,
                     service_options)
from tests.support.polling import until

OPTIONS = (*service_options(grpc_port=50051, metrics_port=9401), *TLS_OPTIONS)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
DEADLINE_S = 20.0


class FakeServicer:
    service_name = "kpoolpd.test.Fake"
    credential = Credential.PEER

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pass


class FakeNode:
    """Records what the runtime calls; ``in_flight`` is what a drain waits for."""

    def __init__(self, context: NodeContext, *, fail_start: bool = False) -> None:
        self.context = context
        self.events = ["build"]
        self.servicer = FakeServicer()
        self.cache = NodeCache(CacheConfig(), num_blocks=4, num_rings=2)
        self.in_flight = 1
        self.fail_start = fail_start
        self.grpc_port = -1
        self.port_open_at_close: bool | None = None
        Gauge("kpoolpd_fake_in_flight", "requests in flight", registry=context.registry).set_function(
            lambda: self.in_flight)

    def warm_up(self) -> None:
        self.events.append("warm_up")

    async def start(self) -> None:
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("peer unreachable")

    def drain(self) -> None:
        self.events.append("drain")

    @property
    def idle(self) -> bool:
        return self.in_flight == 0

    def leftover(self) -> str | None:
        return None if self.idle else f"{self.in_flight} things in flight"

    async def close(self) -> None:
        self.events.append("close")
        if self.grpc_port > 0:
            with socket.socket() as sock:
                self.port_open_at_close = sock.connect_ex(("127.0.0.1", self.grpc_port)) == 0

    def describe(self) -> dict[str, object]:
        return {"fake": True}


def _spec(nodes: list[FakeNode], **kwargs) -> DaemonSpec:
    def build(context: NodeContext) -> FakeNode:
        nodes.append(FakeNode(context, **kwargs))
        return nodes[-1]
    return DaemonSpec(role=Role.PREFILL, description="test daemon", options=OPTIONS, build=build)


def _settings(tmp_path: Path, *extra: str) -> dict:
    return load_settings(Role.PREFILL, OPTIONS, ["--host", "127.0.0.1", "--port", "0", "--metrics-host", "127.0.0.1",
                                                 "--metrics-port", "0", "--health-port", "0", "--ready-file",
                                                 str(tmp_path / "ready.json"), *extra], env={})


def _serve(spec: DaemonSpec, settings: dict) -> asyncio.Task:
    return asyncio.create_task(serve(spec, settings, device=torch.device("cpu"), tls=None,
                                     transports=Transports(offered=(Transport.GRPC_STREAM,))))


async def _health(port: int) -> int:
    async with open_channel(f"127.0.0.1:{port}", None) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_serve_runs_the_steps_in_order_and_drains_until_idle(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    nodes: list[FakeNode] = []
    settings = _settings(tmp_path)
    ready = tmp_path / "ready.json"

    async def scenario() -> dict:
        task = _serve(_spec(nodes), settings)

        async def is_ready() -> bool:
            assert not task.done(), task.exception()
            return ready.exists()
        await until(is_ready, "the ready file", DEADLINE_S)
        info = json.loads(ready.read_text())
        node = nodes[0]
        node.grpc_port = info["grpc_port"]
        assert node.events == ["build", "warm_up", "start"]
        assert [await _health(info["grpc_port"]), await _health(info["health_port"])] == [SERVING, SERVING]
        assert "kpoolpd_fake_in_flight 1.0" in _metrics(info["metrics_port"])

        os.kill(os.getpid(), signal.SIGTERM)

        async def not_serving() -> bool:
            return await _health(info["health_port"]) == NOT_SERVING
        await until(not_serving, "NOT_SERVING after SIGTERM", DEADLINE_S)
        assert node.events[-1] == "drain"
        assert await _health(info["grpc_port"]) == NOT_SERVING  # still answering while draining
        await asyncio.sleep(0.3)
        assert not task.done(), "the drain must wait for the node to be idle"
        node.in_flight = 0
        await asyncio.wait_for(task, DEADLINE_S)
        return info
    info = asyncio.run(scenario())
    node = nodes[0]
    assert node.events == ["build", "warm_up", "start", "drain", "close"]
    assert node.port_open_at_close is False, "the server stops before the node closes"
    assert node.context.engine_id.startswith("prefill-") and node.context.connector_config.peer_token is None
    assert node.context.connector_config.ucx_progress is UcxProgress.AUTO  # the connector's default, unless set
    assert set(info) == {"grpc_port", "metrics_port", "health_port", "engine_id", "pid"}
    assert info["engine_id"] == node.context.engine_id and info["pid"] == os.getpid()
    with pytest.raises(urllib.error.URLError):
        _metrics(info["metrics_port"])
    messages = [r.getMessage() for r in caplog.records]
    order = [next(i for i, m in enumerate(messages) if m.startswith(prefix))
             for prefix in ("warmed up in", "prefill node ready", "SIGTERM: draining", "prefill node stopped")]
    assert order == sorted(order), messages
    assert "prefill node stopped; free: 4 of 4 blocks, 2 of 2 rings" in messages
    (ready_record,) = [r for r in caplog.records if r.getMessage() == "prefill node ready"]
    assert ready_record.fake is True and ready_record.grpc_port == info["grpc_port"] and ready_record.tls is False
    assert not any(r.levelno >= logging.WARNING for r in caplog.records), messages


def test_a_drain_that_runs_out_of_time_warns_and_stops(tmp_path, caplog):
    nodes: list[FakeNode] = []
    settings = _settings(tmp_path, "--drain-s", "0.3")

    async def scenario() -> float:
        task = _serve(_spec(nodes), settings)

        async def is_ready() -> bool:
            return (tmp_path / "ready.json").exists()
        await until(is_ready, "the ready file", DEADLINE_S)
        loop = asyncio.get_running_loop()
        started = loop.time()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(task, DEADLINE_S)
        return loop.time() - started
    took = asyncio.run(scenario())
    assert 0.3 <= took < 5
    assert nodes[0].events[-2:] == ["drain", "close"]
    assert "drain time is up with 1 things in flight" in [r.getMessage() for r in caplog.records
                                                         if r.levelno == logging.WARNING]


def test_the_ucx_progress_setting_reaches_the_connector_config(tmp_path):
    """--ucx-progress (any case) becomes ConnectorConfig.ucx_progress of the node's connectors."""
    settings = _settings(tmp_path, "--ucx-progress", " Thread-Polling ")
    assert settings["ucx_progress"] is UcxProgress.THREAD_POLLING
    context = NodeContext(role=Role.PREFILL, settings=settings, device=torch.device("cpu"), tls=None,
                          transports=Transports(offered=(Transport.GRPC_STREAM,)), registry=None, engine_id="prefill-t")
    assert context.connector_config.ucx_progress is UcxProgress.THREAD_POLLING


def test_a_failed_start_closes_the_node_and_writes_no_ready_file(tmp_path):
    nodes: list[FakeNode] = []

    async def scenario() -> None:
        await asyncio.wait_for(_serve(_spec(nodes, fail_start=True), _settings(tmp_path)), DEADLINE_S)
    with pytest.raises(RuntimeError, match="peer unreachable"):
        asyncio.run(scenario())
    assert nodes[0].events == ["build", "warm_up", "start", "close"]
    assert not (tmp_path / "ready.json").exists()


@pytest.mark.parametrize("argv,needle", [
    pytest.param(["--transports", "tcp"], "transports from flag --transports: ", id="transport"),
    pytest.param(["--log-format", "yaml"], "log-format from flag --log-format: expected one of json, text",
                 id="log-format"),
    pytest.param(["--log-level", "loud"], "log-level from flag --log-level: expected one of DEBUG", id="log-level"),
    pytest.param(["--port", "70000"], "port from flag --port: a port must be in [0, 65535]", id="port"),
    pytest.param(["--ucx-progress", "spin"], "ucx-progress from flag --ucx-progress: expected one of auto, thread, "
                 "thread-polling, got 'spin'", id="ucx-progress"),
])
def test_a_bad_setting_exits_2_naming_it_before_anything_is_built(argv, needle, capsys):
    nodes: list[FakeNode] = []
    assert run_daemon(_spec(nodes), argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kpool-pd prefill: error: ") and needle in err, err
    assert not nodes


@pytest.mark.parametrize("argv,needle", [
    pytest.param(["--layers", "0"], "layers from flag --layers: expected an integer > 0, got '0'", id="layers"),
    pytest.param(["--kpool", "3", "--block-size", "100"], "model: block_size 100 is not a multiple of kpool 3",
                 id="block-size"),
    pytest.param(["--num-spec", "-1"], "num-spec from flag --num-spec: expected an integer >= 0, got '-1'", id="num-spec"),
])
def test_a_model_the_options_do_not_make_exits_2_before_anything_is_built(argv, needle, capsys):
    nodes: list[FakeNode] = []
    build = _spec(nodes).build
    spec = DaemonSpec(role=Role.PREFILL, description="test daemon", options=(*OPTIONS, *MODEL_OPTIONS), build=build)
    assert run_daemon(spec, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kpool-pd prefill: error: ") and needle in err, err
    assert not nodes


def test_a_spec_needs_the_runtime_options_once_each():
    build = _spec([]).build
    with pytest.raises(ValueError, match=r"the runtime needs options \['tls_cert', 'tls_key'\]"):
        DaemonSpec(role=Role.DECODE, description="d", options=OPTIONS[:-4] + TLS_OPTIONS[2:], build=build)
    with pytest.raises(ValueError, match=r"options declared twice: \['host'\]"):
        DaemonSpec(role=Role.DECODE, description="d", options=(*OPTIONS, OPTIONS[0]), build=build)
    with pytest.raises(TypeError, match="role must be a Role"):
        DaemonSpec(role="decode", description="d", options=OPTIONS, build=build)


def test_a_daemon_caps_the_event_loops_wait_for_the_gil():
    import sys

    from kpool_pd.runtime.process import EVENT_LOOP_GIL_WAIT_S, keep_event_loop_responsive

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert keep_event_loop_responsive() == pytest.approx(0.005)
        assert sys.getswitchinterval() == pytest.approx(EVENT_LOOP_GIL_WAIT_S) and EVENT_LOOP_GIL_WAIT_S < 0.005
    finally:
        sys.setswitchinterval(before)
