"""The decode daemon's health says whether it can serve, and a request it cannot serve fails fast
and says why (real daemons, real sockets):

- against a dead prefill address it becomes ready (daemons may start in any order) but reports
  NOT_SERVING on both health ports; a request fails within about 2 s with UNAVAILABLE naming
  the node and ``connection refused``; once the prefill daemon is up it turns SERVING within a few
  health intervals and serves; once the prefill daemon is killed it turns NOT_SERVING again;
- a TLS mismatch either way (a TLS decode daemon dialling a plaintext prefill node, a plaintext
  one dialling a TLS node) is reported as a TLS failure, not as a timeout.

And the pieces: the runtime's health gate (draining wins over the node), the scheduler's room
(a request would be refused: every ring taken and the queue full), and the failure reasons.
"""

from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kpool_pd.connector import open_channel
from kpool_pd.decode_worker.diagnosis import closed_at_once, failure_reason
from kpool_pd.certs import issue, make_ca
from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.runtime.launch import start_decode, start_prefill
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import make_prompts, run_colocated
from kpool_pd.runtime import client_tls, model_flags
from kpool_pd.runtime.health_gate import HealthGate
from tests.support.polling import wait_for
from tests.support.ports import free_port
from tests.workers.test_decode_scheduler import PROMPT, Nodes

MODEL = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=13)
CONFIG = ModelConfig.build(num_spec=3, num_layers=2, seed=13)
INTERVAL_S = 0.3
FLIP_WITHIN_S = 10 * INTERVAL_S + 3.0  # a few health intervals, with room for a loaded 2-core machine
FAIL_WITHIN_S = 3.0
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
DECODE_FLAGS = ["--max-prompt-tokens", "64", "--max-new-tokens", "8", "--max-running", "2", "--log-format", "text",
                "--health-interval-s", str(INTERVAL_S)]


def _health(port: int, tls=None) -> int:
    async def go():
        async with open_channel(f"127.0.0.1:{port}", tls) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return reply.status
    return asyncio.run(go())


def _one_request(port: int, tls=None, prefix: str = "r"):
    requests = make_prompts(1, 20, seed=1, vocab_size=CONFIG.vocab_size, max_tokens=4, prefix=prefix)
    started = time.monotonic()
    result, = asyncio.run(generate_all(f"127.0.0.1:{port}", requests, tls=tls, timeout_s=30))
    return result, time.monotonic() - started, requests


def test_health_follows_the_prefill_node_and_requests_fail_fast_naming_it(tmp_path):
    flags = model_flags(MODEL)
    port = free_port()  # nothing listens here yet
    decode = start_decode(tmp_path, flags, [f"127.0.0.1:{port}"], transport="grpc",
                          extra=[*DECODE_FLAGS, "--health-port", "0"])
    prefill = None
    try:
        decode.wait_ready(120)  # ready without a prefill node: the ready file does not wait for one
        ports = (decode.port, decode.info["health_port"])
        assert [_health(p) for p in ports] == [NOT_SERVING, NOT_SERVING]

        failed, seconds, _ = _one_request(decode.port, prefix="early")
        assert isinstance(failed, RequestFailed) and failed.code is grpc.StatusCode.UNAVAILABLE, failed
        assert seconds < FAIL_WITHIN_S, f"a request with no prefill node took {seconds:.1f} s to fail"
        assert f"127.0.0.1:{port}: connection refused" in failed.message, failed.message

        prefill = start_prefill(tmp_path, flags, transports="grpc",
                                extra=["--port", str(port), "--log-format", "text", "--num-blocks", "32"])
        prefill.wait_ready(120)
        assert wait_for(lambda: all(_health(p) == SERVING for p in ports), FLIP_WITHIN_S), decode.log_tail()
        result, _, requests = _one_request(decode.port, prefix="served")
        want, = run_colocated(CONFIG, requests)
        assert not isinstance(result, RequestFailed), result
        assert (result.output_digest, result.state_digest) == (want.output_digest, want.state_digest)

        prefill.kill()
        assert wait_for(lambda: all(_health(p) == NOT_SERVING for p in ports), FLIP_WITHIN_S), decode.log_tail()
        failed, seconds, _ = _one_request(decode.port, prefix="late")
        assert isinstance(failed, RequestFailed) and failed.code is grpc.StatusCode.UNAVAILABLE, failed
        assert seconds < FAIL_WITHIN_S and f"127.0.0.1:{port}:" in failed.message, (seconds, failed.message)
        assert "prefill node 127.0.0.1:" in decode.log_tail(200)
    finally:
        decode.stop()
        if prefill is not None:
            prefill.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    return {"ca": ca, "daemon": issue(d, ca, "daemon")}


class HealthOnly:
    """A stand-in prefill node for the TLS tests: a real gRPC server on loopback answering
    grpc.health.v1 SERVING, in plaintext or over TLS (in threads of this process)."""

    def __init__(self, pki=None) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
        if pki is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            identity = pki["daemon"]
            credentials = grpc.ssl_server_credentials([(identity.key.read_bytes(), identity.cert.read_bytes())])
            self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None)


@pytest.mark.parametrize("decode_tls", [pytest.param(True, id="tls-decode-to-plaintext-prefill"),
                                        pytest.param(False, id="plaintext-decode-to-tls-prefill")])
def test_a_tls_mismatch_is_reported_as_tls(tmp_path, pki, decode_tls):
    prefill = HealthOnly(None if decode_tls else pki)
    tls_flags, client = [], None
    if decode_tls:
        tls_flags = ["--tls-cert", str(pki["daemon"].cert), "--tls-key", str(pki["daemon"].key),
                     "--tls-ca", str(pki["ca"].cert)]
        client = client_tls(ca=str(pki["ca"].cert))
    decode = start_decode(tmp_path, model_flags(MODEL), [f"127.0.0.1:{prefill.port}"], transport="grpc",
                          extra=[*DECODE_FLAGS, *tls_flags])
    try:
        decode.wait_ready(120)
        assert _health(decode.port, client) == NOT_SERVING
        failed, seconds, _ = _one_request(decode.port, client)
        assert isinstance(failed, RequestFailed) and failed.code is grpc.StatusCode.UNAVAILABLE, failed
        assert seconds < FAIL_WITHIN_S, seconds
        assert f"127.0.0.1:{prefill.port}: TLS handshake failed" in failed.message, failed.message
        assert "plaintext" in failed.message, failed.message  # which side speaks what
        assert "TLS handshake failed" in decode.log_tail(100)
    finally:
        decode.stop()
        prefill.stop()


# the pieces --------------------------------------------------------------------------------
class Reporter:
    """Stands in for the daemon's GrpcServer: records what health it was told."""

    def __init__(self) -> None:
        self.reports: list[bool] = []

    async def set_serving(self, serving: bool) -> None:
        self.reports.append(serving)


def test_the_health_gate_serves_only_while_able_and_never_again_once_draining():
    async def main():
        gate, server = HealthGate(), Reporter()
        gate.set_able(False, "no prefill node is usable")  # before the server is up: remembered
        await gate.open(server)
        assert server.reports == [False] and not gate.serving and gate.reason == "no prefill node is usable"
        gate.set_able(True)
        await asyncio.sleep(0.01)
        assert server.reports[-1] is True and gate.serving
        await gate.drain()
        gate.set_able(False, "gone")
        gate.set_able(True)  # the node is able again, but the daemon drains
        await asyncio.sleep(0.01)
        assert server.reports[-1] is False and not gate.serving
        with pytest.raises(TypeError):
            gate.set_able("yes")
    asyncio.run(main())


@pytest.mark.usefixtures("one_torch_thread")
def test_the_scheduler_reports_when_it_has_no_room_for_a_request():
    async def main():
        async with Nodes() as nodes:
            scheduler, changes = nodes.scheduler, []
            scheduler.on_room_change = changes.append
            jobs = [scheduler.submit(f"r{i}", PROMPT[:10], 4) for i in range(scheduler.max_running)]
            assert scheduler.has_room and changes == []  # every ring taken, the queue empty: room to wait
            jobs += [scheduler.submit(f"w{i}", PROMPT[:10], 4) for i in range(scheduler.max_queue)]
            assert not scheduler.has_room and changes == [False]  # a new request would be refused
            scheduler.abandon(jobs[-1], "cancelled")
            assert scheduler.has_room and changes == [False, True]
            for job in reversed(jobs):  # the waiting ones first: none is admitted on the way
                scheduler.abandon(job, "cancelled")
            assert scheduler.idle and changes == [False, True]
            assert nodes.sample("cancelled_total", state="waiting") == scheduler.max_queue
            assert nodes.sample("cancelled_total", state="prefilling") == scheduler.max_running
    asyncio.run(main())


@pytest.mark.parametrize("code,details,reason", [
    pytest.param(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                 "ipv4:10.0.0.7:50051: Failed to connect to remote host: Connection refused", "connection refused",
                 id="refused"),
    pytest.param(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                 "ipv4:10.0.0.7:50051: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:"
                 "SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK",
                 "TLS handshake failed: CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate",
                 id="untrusted-certificate"),
    pytest.param(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNAVAILABLE: "
                 "ipv4:10.0.0.7:50051: Socket closed", "Socket closed", id="closed"),
    pytest.param(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "no answer within 5.0 s", id="silent"),
    pytest.param(grpc.StatusCode.UNAUTHENTICATED, "missing token", "UNAUTHENTICATED: missing token", id="other"),
])
def test_failure_reasons_say_why_in_words(code, details, reason):
    got = failure_reason(grpc.aio.AioRpcError(code, None, None, details=details), timeout_s=5.0)
    assert got == reason
    assert closed_at_once(got) == (reason == "Socket closed")
