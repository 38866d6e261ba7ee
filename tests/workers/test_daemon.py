"""The two daemons as real processes: readiness, health, metrics, auth, malformed and oversized
requests, bounded queues, a client that goes away, and graceful drain; nothing leaks."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kpool_pd.decode_worker import api as gpb
from kpool_pd.decode_worker.client import RequestFailed, generate_all, generate_one
from kpool_pd.runtime.launch import start_decode, start_prefill
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, make_prompts, run_colocated
from kpool_pd.runtime import model_flags
from tests.support.cli_refusals import refused
from tests.support.ports import free_port
from tests.support.polling import wait_for

TOKEN = "daemon-test-token"  # the client credential (decode's Generate API)
PEER_TOKEN = "daemon-test-peer-token"  # the peer credential (the prefill node's service)
MODEL = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=3)
CONFIG = ModelConfig.build(num_spec=3, num_layers=2, seed=3)
LIMITS = ["--max-prompt-tokens", "300", "--max-new-tokens", "64", "--token", TOKEN, "--peer-token", PEER_TOKEN,
          "--log-format", "text"]
DECODE_BLOCKS = 4 * CONFIG.cache.blocks_for_request(300, 64)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{name} not in /metrics of :{port}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("daemons")
    flags = model_flags(MODEL)
    prefill = start_prefill(workdir, flags, transports="grpc", extra=["--peer-token", PEER_TOKEN, "--num-blocks", "64",
                                                                       "--log-format", "text"])
    daemons = [prefill]
    try:
        prefill.wait_ready(90)
        decode = start_decode(workdir, flags, [f"127.0.0.1:{prefill.port}"], transport="grpc",
                              extra=[*LIMITS, "--max-running", "4", "--num-blocks", str(DECODE_BLOCKS)])
        small = start_decode(workdir, flags, [f"127.0.0.1:{prefill.port}"], transport="grpc", name="decode-small",
                             extra=[*LIMITS, "--max-running", "1", "--max-queue", "1"])
        daemons += [decode, small]
        decode.wait_ready(90)
        small.wait_ready(90)
        yield prefill, decode, small
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


def _call(port: int, request: gpb.GenerateRequest, token: str | None = TOKEN):
    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            md = (("authorization", f"Bearer {token}"),) if token else ()
            return [r async for r in gpb.GenerateServiceStub(channel).Generate(request, timeout=30, metadata=md)]
    return asyncio.run(go())


def test_ready_daemons_report_serving_and_metrics(cluster):
    prefill, decode, _ = cluster

    async def check(port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status
    for daemon in (prefill, decode):
        assert asyncio.run(check(daemon.port)) == health_pb2.HealthCheckResponse.SERVING
    assert metric(decode.metrics_port, "kpoolpd_decode_free_blocks") == DECODE_BLOCKS
    assert metric(prefill.metrics_port, "kpoolpd_prefill_free_blocks") == 64


# -- the command-line client against bad input -----------------------------------------------


def _generate(capsys, *argv: str) -> tuple[int, str]:
    """``kpool-pd generate`` by its entry point in this process (``tests.support.cli_refusals``): its exit status
    and stderr."""
    return refused(capsys, "generate", *argv)


def test_the_client_says_when_the_decode_daemon_cannot_be_reached(capsys):
    unused_port = free_port()  # bound and closed: nothing listens there
    code, err = _generate(capsys, "--decode", f"127.0.0.1:{unused_port}", "--requests", "1")
    assert code == 1
    assert f"error: the decode daemon at 127.0.0.1:{unused_port} did not answer ModelInfo: UNAVAILABLE" in err


def test_the_client_says_when_its_token_is_refused(cluster, capsys):
    _, decode, _ = cluster
    code, err = _generate(capsys, "--decode", f"127.0.0.1:{decode.port}", "--token", "wrong", "--requests", "1")
    assert code == 1 and "Traceback" not in err and "did not answer ModelInfo: UNAUTHENTICATED" in err, err


@pytest.mark.parametrize("flag, value, message", [
    ("--prompt-len", "301", "--prompt-len 301 is above the decode daemon's limit of 300"),
    ("--max-tokens", "65", "--max-tokens 65 is above the decode daemon's limit of 64"),
    ("--requests", "0", "--requests must be >= 1, got 0"),
])
def test_the_client_refuses_counts_the_daemon_would_refuse(cluster, capsys, flag, value, message):
    _, decode, _ = cluster
    code, err = _generate(capsys, "--decode", f"127.0.0.1:{decode.port}", "--token", TOKEN, flag, value)
    assert code == 2 and f"error: {message}" in err, err


def test_the_client_gives_each_request_its_timeout_and_says_what_failed(cluster, capsys):
    """``generate --timeout-s``: a request past its deadline fails DEADLINE_EXCEEDED, the summary names no
    transport plainly (none reached the decode node's data plane), one request is "1 request", and the
    decode daemon frees what the request held."""
    _, decode, _ = cluster
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "generate", "--decode", f"127.0.0.1:{decode.port}",
                           "--token", TOKEN, "--requests", "1", "--prompt-len", "300", "--max-tokens", "64",
                           "--timeout-s", "0.01"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"sending 1 request to 127.0.0.1:{decode.port}" in proc.stderr, proc.stderr
    assert "FAILED DEADLINE_EXCEEDED" in proc.stdout, proc.stdout
    assert "transport none (no request reached the decode node)" in proc.stdout and "transport ;" not in proc.stdout
    assert wait_for(lambda: metric(decode.metrics_port, "kpoolpd_decode_free_blocks") == DECODE_BLOCKS, 60)
    code, err = _generate(capsys, "--decode", f"127.0.0.1:{decode.port}", "--token", TOKEN, "--timeout-s", "0")
    assert code == 2 and "error: --timeout-s must be in (0, 604800] seconds, got 0.0" in err, err


def test_requests_match_colocated(cluster):
    _, decode, _ = cluster
    requests = make_prompts(3, 70, seed=8, vocab_size=CONFIG.vocab_size, max_tokens=20)
    results = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", requests, token=TOKEN))
    reference = run_colocated(CONFIG, requests)
    assert [(r.output_digest, r.state_digest) for r in results] == [
        (r.output_digest, r.state_digest) for r in reference]
    assert all(r.transport == "grpc" and r.transfer_bytes > 0 for r in results)


@pytest.mark.parametrize("request_kwargs,needle", [
    pytest.param(dict(prompt_token_ids=[], max_tokens=4), "prompt has 0 tokens", id="empty-prompt"),
    pytest.param(dict(prompt_token_ids=[1] * 301, max_tokens=4), "prompt has 301 tokens", id="prompt-too-long"),
    pytest.param(dict(prompt_token_ids=[1, 5000], max_tokens=4), "must be in [0, 1024)", id="token-outside-vocab"),
    pytest.param(dict(prompt_token_ids=[1], max_tokens=0), "max_tokens is 0", id="no-output"),
    pytest.param(dict(prompt_token_ids=[1], max_tokens=65), "max_tokens is 65", id="too-many-outputs"),
    pytest.param(dict(request_id="x" * 257, prompt_token_ids=[1], max_tokens=1), "request_id", id="long-id"),
])
def test_malformed_requests_get_invalid_argument(cluster, request_kwargs, needle):
    _, decode, _ = cluster
    with pytest.raises(grpc.RpcError) as info:
        _call(decode.port, gpb.GenerateRequest(**request_kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


def test_oversized_message_and_missing_token_are_refused(cluster):
    _, decode, _ = cluster
    with pytest.raises(grpc.RpcError) as info:
        _call(decode.port, gpb.GenerateRequest(request_id="y" * (17 << 20), prompt_token_ids=[1], max_tokens=1))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:
        _call(decode.port, gpb.GenerateRequest(prompt_token_ids=[1], max_tokens=1), token=None)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def outcomes(port: int, name: str = "kpoolpd_decode_requests_total") -> dict[str, float]:
    """The samples of the counter ``name`` by its ``outcome`` label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            label, value = line.split()
            found[label.split('outcome="')[1].split('"')[0]] = float(value)
    return found


def test_a_full_queue_answers_resource_exhausted_and_counts_each_request_once(cluster):
    _, _, small = cluster
    before = outcomes(small.metrics_port)
    requests = make_prompts(6, 40, seed=4, vocab_size=CONFIG.vocab_size, max_tokens=48)
    results = asyncio.run(generate_all(f"127.0.0.1:{small.port}", requests, token=TOKEN))
    refused = [r for r in results if isinstance(r, RequestFailed)]
    assert refused and all(r.code == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert len(refused) < len(results)
    # every call counted once, when it ended (the served ones once their stream closed)
    assert wait_for(lambda: sum(outcomes(small.metrics_port).values()) - sum(before.values()) == len(requests), 30), \
        (before, outcomes(small.metrics_port))
    after = outcomes(small.metrics_port)
    assert after.get("queue_full", 0) - before.get("queue_full", 0) == len(refused), (before, after)
    assert after.get("ok", 0) - before.get("ok", 0) == len(results) - len(refused), (before, after)
    assert after.get("rejected", 0) == before.get("rejected", 0), (before, after)


def test_a_client_that_goes_away_frees_its_request(cluster):
    prefill, decode, _ = cluster

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            call = gpb.GenerateServiceStub(channel).Generate(
                gpb.GenerateRequest(request_id="leaver", prompt_token_ids=[3] * 200, max_tokens=64), timeout=30,
                metadata=(("authorization", f"Bearer {TOKEN}"),))
            async for response in call:
                if response.WhichOneof("event") == "tokens":
                    call.cancel()
                    break
    asyncio.run(go())
    assert wait_for(lambda: metric(decode.metrics_port, "kpoolpd_decode_free_blocks") == DECODE_BLOCKS)
    assert wait_for(lambda: metric(prefill.metrics_port, "kpoolpd_prefill_free_blocks") == 64)
    assert metric(decode.metrics_port, "kpoolpd_decode_running") == 0


def test_sigterm_drains_then_exits(cluster):
    prefill, decode, _ = cluster
    request = GenerateRequest(request_id="last", prompt=tuple(range(100)), max_tokens=64)

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            stub = gpb.GenerateServiceStub(channel)
            task = asyncio.create_task(generate_one(stub, request, token=TOKEN, timeout_s=60))
            while metric(decode.metrics_port, "kpoolpd_decode_running") < 1:
                await asyncio.sleep(0.02)
            decode.signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            try:
                await generate_one(stub, GenerateRequest(request_id="late", prompt=(1,), max_tokens=2), token=TOKEN,
                                   timeout_s=10)
                late = "OK"
            except RequestFailed as exc:
                late = exc.code
            return await task, late
    result, late = asyncio.run(go())
    assert len(result.tokens) == 64
    assert late == grpc.StatusCode.UNAVAILABLE
    assert decode.proc.wait(30) == 0
    assert f"free: {DECODE_BLOCKS} of {DECODE_BLOCKS} blocks, 4 of 4 rings" in decode.log_tail(3)
    assert wait_for(lambda: metric(prefill.metrics_port, "kpoolpd_prefill_free_blocks") == 64)

