"""The daemons over TLS and on a chosen device: a request through a prefill and a decode daemon
that both require client certificates (mTLS on the Generate API, on the decode node's channels
to the prefill node and on its health checks) equals the colocated run; plaintext clients and
clients without a certificate are refused; bad TLS or device settings stop a daemon at start-up
with a message that names the option."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kpool_pd.connector import open_channel
from kpool_pd.decode_worker.daemon import OPTIONS as DECODE_OPTIONS
from kpool_pd.certs import issue, make_ca
from kpool_pd.decode_worker.client import RequestFailed, generate_all, model_info
from kpool_pd.runtime.launch import start_decode, start_prefill
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import make_prompts, run_colocated
from kpool_pd.prefill_worker.daemon import OPTIONS as PREFILL_OPTIONS
from kpool_pd.runtime import SettingsError, client_tls, load_settings, model_flags, resolve_device, tls_config
from tests.support.daemon_main import run_daemon_main

MODEL = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=11)
CONFIG = ModelConfig.build(num_spec=3, num_layers=2, seed=11)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    rogue = make_ca(d, "rogue-ca")
    return {"dir": d, "ca": ca, "rogue-ca": rogue, "daemon": issue(d, ca, "daemon"),
            "client": issue(d, ca, "client"), "rogue": issue(d, rogue, "rogue")}


def _tls_flags(pki) -> list[str]:
    return ["--tls-cert", str(pki["daemon"].cert), "--tls-key", str(pki["daemon"].key), "--tls-ca",
            str(pki["ca"].cert), "--tls-require-client-auth", "true"]


@pytest.fixture(scope="module")
def tls_cluster(pki, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tls-daemons")
    flags = [*model_flags(MODEL), "--device", "cpu", "--log-format", "text", *_tls_flags(pki)]
    prefill = start_prefill(workdir, flags, transports="grpc", extra=["--health-port", "0"])
    daemons = [prefill]
    try:
        prefill.wait_ready(90)
        decode = start_decode(workdir, flags, [f"127.0.0.1:{prefill.port}"], transport="grpc",
                              extra=["--max-prompt-tokens", "300", "--max-new-tokens", "32", "--health-port", "0",
                                     "--health-interval-s", "0.5"])
        daemons.append(decode)
        decode.wait_ready(90)
        yield prefill, decode
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


def _client(pki, identity: str | None = "client", ca: str = "ca"):
    cert = pki[identity] if identity else None
    return client_tls(ca=str(pki[ca].cert), cert=str(cert.cert) if cert else "", key=str(cert.key) if cert else "")


def _info_code(address: str, tls) -> grpc.StatusCode | None:
    try:
        asyncio.run(model_info(address, tls=tls, timeout_s=5))
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return None


def test_requests_over_mtls_match_colocated(pki, tls_cluster):
    _, decode = tls_cluster
    requests = make_prompts(3, 45, seed=2, vocab_size=CONFIG.vocab_size, max_tokens=12)
    results = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", requests, tls=_client(pki)))
    failed = [r for r in results if isinstance(r, RequestFailed)]
    assert not failed, failed
    want = run_colocated(CONFIG, requests)
    assert [(r.request_id, r.tokens, r.output_digest, r.state_digest) for r in results] == \
        [(r.request_id, r.tokens, r.output_digest, r.state_digest) for r in want]
    assert all(r.transfer_bytes > 0 for r in results)


def test_a_plaintext_client_is_refused(tls_cluster):
    prefill, decode = tls_cluster
    for daemon in (prefill, decode):
        assert _info_code(f"127.0.0.1:{daemon.port}", None) is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("identity,ca", [pytest.param(None, "ca", id="no-client-cert"),
                                         pytest.param("rogue", "ca", id="foreign-client-cert"),
                                         pytest.param("client", "rogue-ca", id="server-not-trusted")])
def test_clients_without_a_trusted_certificate_are_refused(pki, tls_cluster, identity, ca):
    _, decode = tls_cluster
    assert _info_code(f"127.0.0.1:{decode.port}", _client(pki, identity, ca)) is grpc.StatusCode.UNAVAILABLE
    assert _info_code(f"127.0.0.1:{decode.port}", _client(pki)) is None


def test_the_plaintext_health_port_answers_probes(tls_cluster):
    async def check(port: int) -> int:
        async with open_channel(f"127.0.0.1:{port}", None) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status
    for daemon in tls_cluster:
        assert daemon.info["health_port"] > 0
        assert asyncio.run(check(daemon.info["health_port"])) == health_pb2.HealthCheckResponse.SERVING


def test_the_command_line_client_speaks_tls(pki, tls_cluster):
    _, decode = tls_cluster
    proc = subprocess.run([sys.executable, "-m", "kpool_pd", "generate", "--decode", f"localhost:{decode.port}",
                           "--tls-ca", str(pki["ca"].cert), "--tls-cert", str(pki["client"].cert),
                           "--tls-key", str(pki["client"].key), "--requests", "2", "--prompt-len", "9",
                           "--max-tokens", "4", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"ok": 2' in proc.stdout.splitlines()[-1]


# -- settings --------------------------------------------------------------------------------


def _settings(role: str, argv: list[str], env: dict | None = None) -> dict:
    return load_settings(role, PREFILL_OPTIONS if role == "prefill" else DECODE_OPTIONS, argv, description="t",
                         env=env or {})


def test_tls_options_come_from_flags_env_and_file(pki, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"tls-ca: {pki['ca'].cert}\ndecode:\n  tls-server-name: prefill.svc\n")
    env = {"KPOOLPD_TLS_CERT": str(pki["daemon"].cert), "KPOOLPD_TLS_KEY": str(pki["daemon"].key),
           "KPOOLPD_TLS_REQUIRE_CLIENT_AUTH": "true"}
    settings = _settings("decode", ["--config", str(path)], env)
    tls = tls_config(settings)
    assert tls.require_client_auth and tls.server_name_override == "prefill.svc"
    assert tls.root_certs == pki["ca"].cert.read_bytes() and tls.cert_chain == pki["daemon"].cert.read_bytes()
    flagged = _settings("decode", ["--config", str(path), "--tls-server-name", "x"], env)
    assert tls_config(flagged).server_name_override == "x"
    assert tls_config(_settings("prefill", [])) is None
    with pytest.raises(SystemExit):  # the server name is the decode node's option alone
        _settings("prefill", ["--tls-server-name", "x"])


@pytest.mark.parametrize("argv,needle", [
    pytest.param(["--tls-key", "{key}"], "tls-key {key} given without tls-cert", id="key-without-cert"),
    pytest.param(["--tls-cert", "{cert}"], "tls-cert {cert} given without tls-key", id="cert-without-key"),
    pytest.param(["--tls-cert", "{cert}", "--tls-key", "{dir}/none.key"], "tls-key {dir}/none.key: cannot read it",
                 id="missing-key"),
    pytest.param(["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-ca", "{dir}"], "tls-ca {dir}: cannot read it",
                 id="ca-is-a-folder"),
    pytest.param(["--tls-cert", "{dir}/ca.srl-none", "--tls-key", "{key}"], "cannot read it", id="missing-cert"),
    pytest.param(["--tls-cert", "{cert}", "--tls-key", "{dir}/daemon.ext"], "not a PEM file", id="not-pem"),
    pytest.param(["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-require-client-auth", "true"],
                 "tls-require-client-auth needs tls-ca", id="client-auth-without-ca"),
    pytest.param(["--tls-ca", "{ca}"], "tls-ca given without tls-cert and tls-key", id="ca-alone"),
])
def test_bad_tls_settings_name_the_option(pki, argv, needle):
    fill = dict(key=pki["daemon"].key, cert=pki["daemon"].cert, ca=pki["ca"].cert, dir=pki["dir"])
    with pytest.raises(SettingsError) as info:
        tls_config(_settings("prefill", [a.format(**fill) for a in argv]))
    assert needle.format(**fill) in str(info.value)


def test_a_client_key_without_a_certificate_is_refused(pki):
    with pytest.raises(SettingsError, match="tls-key given without tls-cert"):
        client_tls(ca=str(pki["ca"].cert), key=str(pki["client"].key))


@pytest.mark.parametrize("text,want", [("cpu", "cpu"), ("cuda", "cuda"), ("CUDA:1", "cuda:1"), (" cuda:0 ", "cuda:0")])
def test_the_device_option_parses(text, want):
    assert _settings("decode", ["--device", text])["device"] == want
    assert _settings("prefill", [], {"KPOOLPD_DEVICE": text})["device"] == want


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "cpu:0", ""])
def test_a_malformed_device_is_refused(text):
    with pytest.raises(SettingsError, match="device from flag --device: expected cpu, cuda or cuda:N"):
        _settings("decode", ["--device", text])


def test_cuda_without_a_device_fails_with_a_clear_message():
    if resolve_device("cpu").type != "cpu":
        pytest.fail("resolve_device('cpu') must give the CPU")
    import torch
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
        return
    with pytest.raises(SettingsError, match="device cuda: CUDA is not available here"):
        resolve_device("cuda")


@pytest.mark.parametrize("module,argv,needle", [
    pytest.param("kpool_pd.decode_worker", ["--device", "cuda:0"], "device cuda:0: CUDA is not available", id="decode-cuda"),
    pytest.param("kpool_pd.prefill_worker", ["--tls-key", "/nonexistent/k.pem"], "tls-key /nonexistent/k.pem given without "
                 "tls-cert", id="prefill-key-without-cert"),
    pytest.param("kpool_pd.prefill_worker", ["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
                 "tls-cert /nonexistent/c.pem: cannot read it", id="prefill-missing-cert"),
])
def test_a_daemon_with_bad_settings_exits_2_with_the_reason(tmp_path, module, argv, needle):
    """The daemon's main in a forked child (``tests.support.daemon_main``; the refusals of
    ``test_daemon_settings_refused`` run the command itself)."""
    import torch
    if "cuda" in needle and torch.cuda.is_available():
        pytest.fail("this check of the missing-CUDA message needs a machine without CUDA")
    exited = run_daemon_main(module, [*argv, "--port", "0", "--metrics-port", "-1"], os.environ, tmp_path)
    assert exited.status == 2, exited.stderr
    assert needle in exited.stderr and "Traceback" not in exited.stderr
