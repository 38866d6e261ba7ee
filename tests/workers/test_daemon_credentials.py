"""The daemons' credentials and ports, as real processes attacked from outside: a decode daemon
serves its Generate API to the client token (and to no other), a prefill daemon its
PrefillService to a session that proved the peer token (and never to the client token, nor to the
peer token sent in clear); junk request bytes get
INVALID_ARGUMENT and no traceback; an unnamed request's id says nothing of the engine; a prefill
daemon given only the client token, or one token for both, refuses to start; and a daemon started
on a port another one serves exits with status 2 naming the port while the first keeps serving."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kpool_pd.connector import auth_metadata
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.wire import layout_message
from kpool_pd.decode_worker import api as gpb
from kpool_pd.decode_worker.daemon import OPTIONS as DECODE_OPTIONS
from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.runtime.launch import start_decode, start_prefill
from kpool_pd.kvcache import BlockLayout
from kpool_pd.model.colocated import make_prompts
from kpool_pd.prefill_worker.daemon import OPTIONS as PREFILL_OPTIONS
from kpool_pd.runtime import Role, SettingsError, load_settings, model_config, model_flags
from kpool_pd.runtime.service_options import check_credentials
from tests.support.peer_credentials import peer_metadata

CLIENT_TOKEN = "credentials-test-client-token"
PEER_TOKEN = "credentials-test-peer-token"
MODEL = dict(family="kpool", kpool=4, ratio=4, num_spec=3, layers=2, block_size=0, seed=5)
COMMON = ["--max-prompt-tokens", "128", "--log-format", "text"]
JUNK = b"\xff\xff\xff\xff\x0f"
FAIL_FAST_S = 45.0  # a refusal comes before the warm-up: the time to import torch and parse flags


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("credentials")
    flags = model_flags(MODEL)
    prefill = start_prefill(workdir, flags, transports="grpc",
                            extra=[*COMMON, "--peer-token", PEER_TOKEN, "--num-blocks", "32", "--num-rings", "8"])
    daemons = [prefill]
    try:
        prefill.wait_ready(90)
        decode = start_decode(workdir, flags, [f"127.0.0.1:{prefill.port}"], transport="grpc",
                              env={"KPOOLPD_PEER_TOKEN": PEER_TOKEN},  # from the environment, as the manifests do
                              extra=[*COMMON, "--token", CLIENT_TOKEN, "--max-new-tokens", "8", "--max-running", "2"])
        daemons.append(decode)
        decode.wait_ready(90)
        yield workdir, prefill, decode
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


def _prompts(n: int = 1):
    config = model_config(MODEL)
    return make_prompts(n, 20, seed=1, vocab_size=config.vocab_size, max_tokens=4)


async def _raw(port: int, method: str, payload: bytes, metadata=()):
    """A PrefillService call made without the stubs; the reply's bytes, or the error."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        path = f"/{pb.SERVICE_NAME}/{method}"
        try:
            if method == "Pull":
                call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
                return [r async for r in call(payload, timeout=10, metadata=metadata)]
            if method == "PullSession":  # one message, then the client's side closes
                call = channel.stream_stream(path, request_serializer=None, response_deserializer=None)
                return [r async for r in call(iter([payload]), timeout=10, metadata=metadata)]
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            return await call(payload, timeout=10, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            return exc


def _generate_started(port: int, metadata) -> gpb.GenerateStarted:
    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = gpb.GenerateRequest(prompt_token_ids=list(_prompts()[0].prompt), max_tokens=2)
            async for reply in gpb.GenerateServiceStub(channel).Generate(request, timeout=60, metadata=metadata):
                if reply.WhichOneof("event") == "started":
                    started = reply.started
            return started
    return asyncio.run(go())


def _health(port: int) -> int:
    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)).status
    return asyncio.run(go())


def test_generate_takes_the_client_token_in_any_scheme_case_and_not_the_peer_token(cluster):
    _, _, decode = cluster
    results = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", _prompts(2), token=CLIENT_TOKEN))
    assert not [r for r in results if isinstance(r, RequestFailed)], results
    assert _generate_started(decode.port, (("authorization", f"bearer {CLIENT_TOKEN}"),)).transfer_bytes > 0
    for token in (PEER_TOKEN, None):
        (refused,) = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", _prompts(1), token=token))
        assert isinstance(refused, RequestFailed) and refused.code is grpc.StatusCode.UNAUTHENTICATED, refused


def test_the_client_token_never_opens_the_prefill_daemon(cluster):
    _, prefill, _ = cluster
    layout = layout_message(BlockLayout(model_config(MODEL).cache))
    requests = {
        "Handshake": pb.HandshakeRequest(engine_id="client-posing-as-decode", layout=layout, transports=[pb.TRANSPORT_GRPC_STREAM]),
        "Prefill": pb.PrefillRequest(request_id="stolen", prompt_token_ids=[1] * 10, engine_id="client-posing-as-decode"),
        "Pull": pb.PullRequest(grant_id="0" * 32, engine_id="client-posing-as-decode", transport=pb.TRANSPORT_GRPC_STREAM),
        "PullSession": pb.PullSessionRequest(pull=pb.PullRequest(grant_id="0" * 32, engine_id="client-posing-as-decode",
                                                                 transport=pb.TRANSPORT_UCX, ucx_tag_base=1)),
        "Release": pb.ReleaseRequest(grant_id="0" * 32, engine_id="client-posing-as-decode"),
        "Heartbeat": pb.HeartbeatRequest(engine_id="client-posing-as-decode", grant_ids=["0" * 32]),
    }
    for method, request in requests.items():
        for token in (CLIENT_TOKEN, None, PEER_TOKEN):  # the peer token in clear is refused too
            refused = asyncio.run(_raw(prefill.port, method, request.SerializeToString(), auth_metadata(token)))
            assert isinstance(refused, grpc.aio.AioRpcError), (method, token, refused)
            assert refused.code() is grpc.StatusCode.UNAUTHENTICATED, (method, token, refused)
    # a session proved through PeerAuth opens it: each call gets past auth to the service's own answer
    peer = asyncio.run(peer_metadata(f"127.0.0.1:{prefill.port}", PEER_TOKEN))
    for method, request in requests.items():
        reply = asyncio.run(_raw(prefill.port, method, request.SerializeToString(), peer))
        assert not isinstance(reply, grpc.aio.AioRpcError) or reply.code() is not grpc.StatusCode.UNAUTHENTICATED, \
            (method, reply)
    reply = asyncio.run(_raw(prefill.port, "Heartbeat", requests["Heartbeat"].SerializeToString(), peer))
    assert pb.HeartbeatResponse.FromString(reply).lease_ms > 0


def test_junk_bytes_to_the_prefill_daemon_answer_invalid_argument_without_a_traceback(cluster):
    _, prefill, _ = cluster
    peer = asyncio.run(peer_metadata(f"127.0.0.1:{prefill.port}", PEER_TOKEN))
    for method in ("Handshake", "Prefill", "Pull", "PullSession", "Release", "Heartbeat"):
        got = asyncio.run(_raw(prefill.port, method, JUNK, peer))
        assert isinstance(got, grpc.aio.AioRpcError) and got.code() is grpc.StatusCode.INVALID_ARGUMENT, (method, got)
    assert _health(prefill.port) == health_pb2.HealthCheckResponse.SERVING
    log = prefill.log_tail(400)
    assert "malformed request to" in log
    assert "Traceback" not in log and "Unexpected" not in log and "ERROR" not in log, log


def test_an_unnamed_request_gets_a_random_id_that_does_not_name_the_engine(cluster):
    _, _, decode = cluster
    engine_id = decode.info["engine_id"]
    ids = [_generate_started(decode.port, auth_metadata(CLIENT_TOKEN)).request_id for _ in range(2)]
    for request_id in ids:
        assert re.fullmatch(r"[0-9a-f]{16}", request_id), request_id
        assert engine_id not in request_id and "decode" not in request_id
    assert ids[0] != ids[1]


@pytest.mark.parametrize("extra,needle", [
    (["--token", CLIENT_TOKEN], "give peer-token"),
    (["--token", PEER_TOKEN, "--peer-token", PEER_TOKEN], "peer-token must differ from token"),
], ids=["client-token-only", "one-token-for-both"])
def test_a_prefill_daemon_without_a_working_peer_credential_refuses_to_start(cluster, extra, needle):
    workdir, _, _ = cluster
    started = time.monotonic()
    daemon = start_prefill(workdir, model_flags(MODEL), name="refused-prefill", transports="grpc", extra=[*COMMON, *extra])
    try:
        assert daemon.proc.wait(FAIL_FAST_S) == 2, daemon.log_tail()
    finally:
        daemon.stop()
    assert time.monotonic() - started < FAIL_FAST_S
    log = daemon.log_path.read_text()
    assert "kpool-pd prefill: error: " in log and needle in log, log
    assert CLIENT_TOKEN not in log and PEER_TOKEN not in log, "an error must not print a token"


def test_a_daemon_on_a_served_port_exits_naming_it_and_the_first_keeps_serving(cluster):
    workdir, prefill, decode = cluster
    for name, start in (("second-prefill", start_prefill), ("decode-on-prefill-port", start_decode)):
        kwargs = {"transports": "grpc"} if start is start_prefill else {"prefill": [f"127.0.0.1:{prefill.port}"],
                                                                          "transport": "grpc"}
        started = time.monotonic()
        second = start(workdir, model_flags(MODEL), name=name,
                       extra=[*COMMON, "--peer-token", PEER_TOKEN, "--port", str(prefill.port)], **kwargs)
        try:
            assert second.proc.wait(FAIL_FAST_S) == 2, second.log_tail()
        finally:
            second.stop()
        assert time.monotonic() - started < FAIL_FAST_S
        log = second.log_path.read_text()
        assert f"port: port {prefill.port} on 127.0.0.1 is in use" in log, log
    assert _health(prefill.port) == health_pb2.HealthCheckResponse.SERVING
    results = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", _prompts(2), token=CLIENT_TOKEN))
    assert not [r for r in results if isinstance(r, RequestFailed)], results
    assert prefill.proc.poll() is None


# the settings, without processes -----------------------------------------------------------
def test_the_peer_token_comes_from_a_flag_the_environment_or_the_yaml_file(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("peer-token: from-yaml\ndecode:\n  token: client-from-yaml\n")
    assert load_settings("decode", DECODE_OPTIONS, ["--config", str(config)])["peer_token"] == "from-yaml"
    from_env = load_settings("decode", DECODE_OPTIONS, ["--config", str(config)], env={"KPOOLPD_PEER_TOKEN": "from-env"})
    assert from_env["peer_token"] == "from-env" and from_env["token"] == "client-from-yaml"
    from_flag = load_settings("decode", DECODE_OPTIONS, ["--peer-token", "from-flag"], env={"KPOOLPD_PEER_TOKEN": "e"})
    assert from_flag["peer_token"] == "from-flag" and from_flag["token"] == ""


@pytest.mark.parametrize("role,token,peer_token,refused", [
    ("decode", "c", "", None), ("decode", "", "p", None), ("decode", "c", "p", None),
    ("prefill", "", "p", None), ("prefill", "", "", None), ("prefill", "c", "p", None),
    ("prefill", "c", "", "give peer-token"), ("decode", "same", "same", "must differ"),
    ("prefill", "same", "same", "must differ"),
])
def test_which_credentials_a_daemon_accepts(role, token, peer_token, refused):
    settings = {"token": token, "peer_token": peer_token}
    if refused is None:
        check_credentials(Role(role), settings)
    else:
        with pytest.raises(SettingsError, match=refused):
            check_credentials(Role(role), settings)


@pytest.mark.parametrize("value", ["has space", "tab\there", "newline\n", "caf\u00e9"])
def test_a_token_that_metadata_cannot_carry_is_refused_without_showing_it(value):
    with pytest.raises(SettingsError) as err:
        load_settings("prefill", PREFILL_OPTIONS, ["--peer-token", value])
    assert "peer-token from flag --peer-token" in str(err.value) and value not in str(err.value)
