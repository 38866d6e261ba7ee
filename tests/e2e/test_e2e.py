"""End to end: prefill and decode daemons as real processes; every PD run must equal the colocated
run byte for byte (output and state digests).

The matrix runs one prefill daemon and two decode daemons per model configuration (one pulling
over UCX, one over the gRPC stream; so one prefill serves two decode workers), with 16
concurrent requests on each decode daemon whose prompt lengths sit on and around the pool, ring
and block boundaries (1 token included). Then: one decode worker using two prefill workers (one
found through DNS), a prefill worker killed while requests are in flight, a decode worker killed
in the middle of its requests, and prefill and decode in two network namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Sequence

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kpool_pd.connector import ucx_available
from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.runtime.launch import Daemon, start_decode, start_prefill
from kpool_pd.kvcache import CacheFamily, family_spec_type
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, RequestResult, make_prompts, run_colocated
from kpool_pd.runtime import model_flags, model_settings
from tests.support.polling import wait_for
from tests.support.ports import free_port
from tests.support.served_nodes import match_and_free as served_match_and_free
from tests.support.served_nodes import pd_nodes

pytestmark = pytest.mark.usefixtures("one_torch_thread")
READY_S = 120
SETTLE_S = 20.0  # how long freed blocks may take to show in the metrics
TRANSPORTS = ["ucx", "grpc"] if ucx_available() else ["grpc"]
# Tests not about the default block size run 128-token blocks: their prompts of up to 3 blocks stay short.
DECODE_LIMITS = ["--max-prompt-tokens", "512", "--max-new-tokens", "256", "--max-running", "16",
                 "--log-format", "text"]


def _flags(config: ModelConfig) -> list[str]:
    return model_flags(model_settings(config))


def _metric(daemon: Daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def _free_blocks(daemon: Daemon) -> float:
    role = "prefill" if daemon.name.startswith("prefill") else "decode"
    return _metric(daemon, f"kpoolpd_{role}_free_blocks")


def _ready(*daemons: Daemon) -> None:
    for daemon in daemons:
        daemon.wait_ready(READY_S)


def _serving(daemon: Daemon) -> bool:
    """The daemon's grpc.health.v1 answer is SERVING (a decode daemon: a prefill node is usable)."""
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _ready_and_serving(*daemons: Daemon) -> None:
    """Ready, then SERVING: the daemons boot at once, and a decode daemon serves only once it has
    handshaken with a prefill node, which a loaded machine may take a while to finish."""
    _ready(*daemons)
    for daemon in daemons:
        assert wait_for(lambda daemon=daemon: _serving(daemon), READY_S), f"{daemon.name} never SERVING:\n{daemon.log_tail()}"


def _stop(*daemons: Daemon) -> None:
    """SIGTERM all at once (they drain in parallel), then wait for each."""
    for daemon in daemons:
        daemon.signal(signal.SIGTERM)
    for daemon in daemons:
        daemon.stop()


def boundary_prompts(config: ModelConfig, count: int, max_tokens: int, *, seed: int, prefix: str
                     ) -> list[GenerateRequest]:
    """Prompt lengths on and around the pool (group), ring and block boundaries, 1 included,
    then seeded random lengths up to ``count`` requests."""
    g, ring, block = config.cache.tokens_per_entry, config.cache.ring_slots, config.cache.block_size
    lengths = sorted({n for base in (g, ring, block, 2 * block + g) for n in (base - 1, base, base + 1) if n >= 1}
                     | {1})
    rng = random.Random(seed)
    while len(lengths) < count:
        lengths.append(rng.randint(1, 3 * block))
    prompts = make_prompts(count, max(lengths), seed=seed, vocab_size=config.vocab_size, max_tokens=max_tokens,
                           prefix=prefix)
    return [GenerateRequest(request_id=p.request_id, prompt=p.prompt[:n], max_tokens=max_tokens)
            for p, n in zip(prompts, lengths[:count])]


@contextlib.contextmanager
def _logs_on_failure(*daemons: Daemon):
    """Add the daemons' last log lines to a failing assertion's message."""
    try:
        yield
    except AssertionError as exc:
        tails = "\n".join(f"--- {d.name} ---\n{d.log_tail(40)}" for d in daemons)
        raise AssertionError(f"{exc}\n{tails}") from None


def _assert_match(results, reference: list[RequestResult]) -> None:
    by_id = {r.request_id: r for r in reference}
    for result in results:
        assert isinstance(result, RequestResult), f"{result}"
        want = by_id[result.request_id]
        assert (result.tokens, result.output_digest, result.state_digest) == (
            want.tokens, want.output_digest, want.state_digest), f"{result.request_id} (prompt {result.prompt_len})"


def generate_and_match(decodes, batches: dict, references: dict) -> list[list]:
    """Send each transport's batch to its decode daemon (all at once); every request succeeds over that
    transport and equals its colocated reference. Returns the results per decode daemon."""
    async def everything():
        return await asyncio.gather(*(generate_all(f"127.0.0.1:{d.port}", batches[t])
                                      for d, t in zip(decodes, TRANSPORTS)))
    outcomes = asyncio.run(everything())
    for transport, results in zip(TRANSPORTS, outcomes):
        failed = [r for r in results if isinstance(r, RequestFailed)]
        assert not failed, f"{len(failed)} failed over {transport}: {failed[0]}"
        assert {r.transport for r in results} == {transport}
        _assert_match(results, references[transport])
    return outcomes


# 128-token blocks where the ring divides 128 (prompts of at most 3 blocks stay short on 2 cores), 256 for kpool 8 (the
# daemons refuse kernel pages under 32 states: runtime.geometry), and the default block (256 tokens: kpool 2 holds
# 128 states a block, two kernel pages) once.
MATRIX = [pytest.param(family, group, spec, 256 if (family, group) == (CacheFamily.KPOOL, 8) else 128,
                       id=f"{family.value}-{group}-spec{spec}")
          for family in (CacheFamily.KPOOL, CacheFamily.QSA) for group in (2, 4, 8) for spec in (0, 3)]
MATRIX.append(pytest.param(CacheFamily.KPOOL, 2, 3, None, id="kpool-2-spec3-default-block-two-pages"))
DAEMON_MATRIX = [param for param in MATRIX if param.id in ("kpool-2-spec3-default-block-two-pages", "qsa-4-spec3")]


@contextlib.contextmanager
def pd_pair(tmp_path, prefill_flags: list[str], decode_flags: list[str] | None = None, *,
            prefill_blocks: int = 256, prefill_extra: Sequence[str] = (), decode_extra: Sequence[str] = ()):
    """One prefill daemon on a port named in advance and one decode daemon per transport pulling from it,
    all booting at once (a decode daemon retries the port until it serves); their logs on a failure;
    stopped afterwards. Yields ``(prefill, decodes)``."""
    port = free_port()
    prefill = start_prefill(tmp_path, prefill_flags, extra=["--port", str(port), "--num-blocks",
                                                            str(prefill_blocks), "--log-format", "text", *prefill_extra])
    decodes = [start_decode(tmp_path, decode_flags or prefill_flags, [f"127.0.0.1:{port}"], name=f"decode-{t}",
                            transport=t, extra=[*DECODE_LIMITS, *decode_extra, "--health-interval-s", "0.5"])
               for t in TRANSPORTS]
    try:
        with _logs_on_failure(prefill, *decodes):
            yield prefill, decodes
    finally:
        _stop(*decodes, prefill)


def match_and_free(prefill: Daemon, decodes: list[Daemon], batches: dict, references: dict) -> list[list]:
    """Once every daemon serves: each batch through its decode daemon equals its colocated reference
    (``generate_and_match``), and every daemon has all its blocks free again afterwards."""
    _ready_and_serving(prefill, *decodes)
    start_free = [_free_blocks(d) for d in (prefill, *decodes)]
    outcomes = generate_and_match(decodes, batches, references)
    assert wait_for(lambda: [_free_blocks(d) for d in (prefill, *decodes)] == start_free, SETTLE_S)
    return outcomes


def _matrix_case(family, group, num_spec, block_size):
    """The model of a MATRIX row and the decode limit its longest prompt needs."""
    key = "kpool" if family is CacheFamily.KPOOL else "compress_ratio"
    if block_size is not None:  # the least multiple of 128 that the ring divides (QSA ratio 2, 3 drafts: 6 -> 384)
        block_size = math.lcm(block_size, family_spec_type(family).ring_slots_for(group, num_spec))
    config = ModelConfig.build(family=family, num_layers=2, num_spec=num_spec, seed=group + num_spec, block_size=block_size,
                         **{key: group})
    longest = ["--max-prompt-tokens", str(max(512, 3 * config.cache.block_size))]  # boundary_prompts' longest
    return config, longest


def _matrix_batches(config, group, num_spec):
    max_tokens = max(10, group + 3)
    batches = {t: boundary_prompts(config, 16, max_tokens, seed=num_spec, prefix=t) for t in TRANSPORTS}
    return batches, {t: run_colocated(config, batches[t]) for t in TRANSPORTS}


@pytest.mark.parametrize("family,group,num_spec,block_size", MATRIX)
def test_pd_equals_colocated(family, group, num_spec, block_size):
    """The matrix with the daemons' nodes in this process (``tests.support.served_nodes``: the same flags, the
    same nodes and gRPC servers), one decode node per transport."""
    config, longest = _matrix_case(family, group, num_spec, block_size)
    batches, references = _matrix_batches(config, group, num_spec)

    async def main():
        decode_extra = [*DECODE_LIMITS, *longest, "--health-interval-s", "0.5"]
        async with pd_nodes(_flags(config), TRANSPORTS, prefill_extra=["--num-blocks", "256"],
                            decode_extra=decode_extra) as (prefill, decodes):
            await served_match_and_free(prefill, decodes, batches, references)
    asyncio.run(main())


@pytest.mark.parametrize("family,group,num_spec,block_size", DAEMON_MATRIX)
def test_pd_daemons_equal_colocated(tmp_path, family, group, num_spec, block_size):
    """The daemons as processes, once per family, each with a decode daemon per transport."""
    config, longest = _matrix_case(family, group, num_spec, block_size)
    with pd_pair(tmp_path, _flags(config), decode_extra=longest) as (prefill, decodes):
        batches, references = _matrix_batches(config, group, num_spec)
        match_and_free(prefill, decodes, batches, references)


def _two_prefills(tmp_path, flags, extra=()):
    a = start_prefill(tmp_path, flags, name="prefill-a", extra=["--log-format", "text", *extra])
    b = start_prefill(tmp_path, flags, name="prefill-b", extra=["--log-format", "text", *extra])
    _ready(a, b)
    return a, b


def test_one_decode_worker_uses_two_prefill_workers_and_survives_losing_one(tmp_path):
    config = ModelConfig.build(num_layers=2, num_spec=3, seed=21, block_size=128)
    flags = _flags(config)
    a, b = _two_prefills(tmp_path, flags)
    decode = start_decode(tmp_path, flags, [f"127.0.0.1:{a.port}", f"dns:///localhost:{b.port}"],
                          transport=TRANSPORTS[0], extra=[*DECODE_LIMITS, "--health-interval-s", "0.5"])
    try:
        with _logs_on_failure(decode, a, b):
            _ready(decode)
            # Ready means one prefill node is usable; on a loaded machine the other's first check may time
            # out, so wait until the decode node has found both healthy before counting who served what.
            assert wait_for(lambda: all(f"prefill node 127.0.0.1:{p.port} is healthy" in decode.log_tail(400)
                                        for p in (a, b)), READY_S), decode.log_tail(20)
            decode_free = _free_blocks(decode)
            address = f"127.0.0.1:{decode.port}"
            requests = boundary_prompts(config, 8, 12, seed=1, prefix="both")
            results = asyncio.run(generate_all(address, requests))
            _assert_match(results, run_colocated(config, requests))
            assert {r.prefill_worker for r in results} == {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}

            # Kill prefill A while requests are in flight: each request either completes and matches
            # or fails with a clear transfer error; nothing stays allocated; B serves what follows.
            requests = make_prompts(12, 300, seed=2, vocab_size=config.vocab_size, max_tokens=24, prefix="kill")

            async def with_a_killed():
                task = asyncio.ensure_future(generate_all(address, requests))
                while not task.done() and _metric(decode, "kpoolpd_decode_running") + _metric(decode, "kpoolpd_decode_waiting") < 1:
                    await asyncio.sleep(0.01)
                a.kill()
                return await task
            results = asyncio.run(with_a_killed())
            reference = {r.request_id: r for r in run_colocated(config, requests)}
            ok = [r for r in results if isinstance(r, RequestResult)]
            failed = [r for r in results if isinstance(r, RequestFailed)]
            assert ok, "requests on the surviving prefill worker must finish"
            _assert_match(ok, list(reference.values()))
            assert all(f.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INTERNAL) and f.message for f in failed)
            assert wait_for(lambda: _metric(decode, "kpoolpd_decode_reserved_blocks") == 0, SETTLE_S)
            assert _free_blocks(decode) == decode_free
            after = make_prompts(4, 50, seed=3, vocab_size=config.vocab_size, max_tokens=8, prefix="after")
            results = asyncio.run(generate_all(address, after))
            _assert_match(results, run_colocated(config, after))
            assert {r.prefill_worker for r in results} == {f"127.0.0.1:{b.port}"}
    finally:
        _stop(decode, a, b)


DOOMED_TOKENS = 4096


def test_a_decode_worker_killed_mid_request_fails_only_its_requests(tmp_path):
    config = ModelConfig.build(family=CacheFamily.QSA, num_layers=2, num_spec=3, seed=5, block_size=128)
    flags = _flags(config)
    prefill = start_prefill(tmp_path, flags, extra=["--lease-s", "2", "--num-blocks", "128", "--log-format", "text"])
    try:
        _ready(prefill)
        # the doomed requests are long (4,096 new tokens each), so that none ends before the last of them is running:
        # with 256 a loaded machine finished the first before the fourth had its blocks, and the kill came after
        victim = start_decode(tmp_path, flags, [f"127.0.0.1:{prefill.port}"], name="decode-victim",
                              transport=TRANSPORTS[0], extra=[*DECODE_LIMITS, "--max-new-tokens", str(DOOMED_TOKENS)])
        survivor = start_decode(tmp_path, flags, [f"127.0.0.1:{prefill.port}"], name="decode-survivor",
                                transport="grpc", extra=DECODE_LIMITS)
        _ready(victim, survivor)
        prefill_free, survivor_free = _free_blocks(prefill), _free_blocks(survivor)
        doomed = make_prompts(4, 90, seed=6, vocab_size=config.vocab_size, max_tokens=DOOMED_TOKENS, prefix="doomed")
        fine = make_prompts(4, 90, seed=7, vocab_size=config.vocab_size, max_tokens=40, prefix="fine")

        async def scenario():
            survivors = asyncio.ensure_future(generate_all(f"127.0.0.1:{survivor.port}", fine))
            victims = asyncio.ensure_future(generate_all(f"127.0.0.1:{victim.port}", doomed))
            while not victims.done() and _metric(victim, "kpoolpd_decode_running") < len(doomed):
                await asyncio.sleep(0.01)
            victim.kill()
            return await victims, await survivors
        lost, kept = asyncio.run(scenario())
        outcomes = [r.code.name if isinstance(r, RequestFailed) else f"ended with {len(r.tokens)} tokens" for r in lost]
        assert outcomes == ["UNAVAILABLE"] * len(doomed), outcomes
        _assert_match(kept, run_colocated(config, fine))
        assert wait_for(lambda: _free_blocks(prefill) == prefill_free, SETTLE_S)
        assert wait_for(lambda: _free_blocks(survivor) == survivor_free, SETTLE_S)
        _stop(survivor)
    finally:
        _stop(prefill)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is not installed"
    return None


class NetnsPair:
    """Two network namespaces joined by a veth pair, 10.213.<n>.1 and .2/24, loopback up."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}"
        self.names = (f"kpd-p{tag}", f"kpd-d{tag}")
        self.addresses = (f"10.213.{os.getpid() % 250}.1", f"10.213.{os.getpid() % 250}.2")
        self.links = (f"kpdp{tag}", f"kpdd{tag}")
        self._made: list[str] = []

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)

    def __enter__(self) -> "NetnsPair":
        try:
            for name in self.names:
                self._ip("netns", "add", name)
                self._made.append(name)
                self._ip("-n", name, "link", "set", "lo", "up")
            self._ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for name, link, address in zip(self.names, self.links, self.addresses):
                self._ip("link", "set", link, "netns", name)
                self._ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                self._ip("-n", name, "link", "set", link, "up")
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            pytest.skip(f"cannot make network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
        return self

    def __exit__(self, *exc) -> None:
        for name in self._made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
        self._made.clear()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_and_decode_in_two_network_namespaces(tmp_path, transport):
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    config = ModelConfig.build(num_layers=2, num_spec=3, seed=9, block_size=128)
    flags = _flags(config)
    requests = boundary_prompts(config, 6, 12, seed=4, prefix="ns")
    with NetnsPair() as ns:
        prefill = Daemon("kpool_pd.prefill_worker", ["--host", ns.addresses[0], "--port", "0", "--metrics-port", "-1",
                                            "--log-format", "text", *flags], tmp_path, "prefill", netns=ns.names[0])
        decode = None
        try:
            prefill.wait_ready(READY_S)
            decode = Daemon("kpool_pd.decode_worker", ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
                                              "--prefill", f"{ns.addresses[0]}:{prefill.port}",
                                              "--transport", transport, *DECODE_LIMITS, *flags],
                            tmp_path, "decode", netns=ns.names[1])
            decode.wait_ready(READY_S)
            # The client runs beside the decode daemon, inside its namespace.
            proc = subprocess.run(
                ["ip", "netns", "exec", ns.names[1], sys.executable, "-c",
                 "import asyncio, json, sys; from kpool_pd.decode_worker.client import generate_all; "
                 "from kpool_pd.model.colocated import GenerateRequest; "
                 "reqs = [GenerateRequest(**r) for r in json.loads(sys.argv[2])]; "
                 "out = asyncio.run(generate_all(sys.argv[1], reqs)); "
                 "print(json.dumps([r.as_json() for r in out]))",
                 f"127.0.0.1:{decode.port}",
                 json.dumps([{"request_id": r.request_id, "prompt": list(r.prompt), "max_tokens": r.max_tokens}
                             for r in requests])],
                capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, proc.stderr[-2000:]
            rows = json.loads(proc.stdout)
        finally:
            _stop(*(d for d in (decode, prefill) if d is not None))
    reference = {r.request_id: r for r in run_colocated(config, requests)}
    for row in rows:
        assert row["transport"] == transport and row["prefill_worker"].startswith(ns.addresses[0])
        want = reference[row["request_id"]]
        assert (row["output_digest"], row["state_digest"]) == (want.output_digest, want.state_digest)
