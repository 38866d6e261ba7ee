"""The prefill node's service edge as an attacker meets it, over loopback sockets: two credentials
(the client token never opens the PrefillService, nor the peer token sent in clear; a session proved
through PeerAuth does; health and PeerAuth need none), the KpoolPd-Peer and Bearer schemes in any case,
raw junk bytes to every method (INVALID_ARGUMENT, no ERROR traceback), and a server that will not
share its port. ``tests/connector/test_peer_challenge.py`` tests the challenge itself."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, PrefillConnector, Transport, auth_metadata
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.auth import FIRST_MESSAGE_WAIT_S, presented_token
from kpool_pd.connector.shared.peer_auth import presented_session
from kpool_pd.kvcache import NodeCache
from kpool_pd.runtime import GrpcServer
from kpool_pd.runtime.ports import BindError, ensure_bindable
from tests.support.connector_procs import CONFIG, SeededFillEngine
from tests.support.deadlines import patient
from tests.support.log_records import errors_logged, own_records
from tests.support.peer_credentials import peer_metadata

CLIENT_TOKEN, PEER_TOKEN = "client-secret", "peer-secret"
SERVICE = f"/{pb.SERVICE_NAME}/"
UNARY = ("Handshake", "Prefill", "Release", "Heartbeat")
METHODS = (*UNARY, "Pull")
JUNK = b"\xff\xff\xff\xff\x0f"  # field 31, wire type 7: no protobuf message parses it


class Served:
    """A prefill connector behind a GrpcServer that knows both tokens (as a decode daemon's would
    not: the worst case, where the client token is at hand on the same server)."""

    def __init__(self, *, client_token: str | None = CLIENT_TOKEN, peer_token: str | None = PEER_TOKEN) -> None:
        self.cache = NodeCache(CONFIG, num_blocks=8, num_rings=2)
        self.node = PrefillConnector(self.cache.pool, SeededFillEngine(self.cache), engine_id="prefill-auth",
                                     config=ConnectorConfig(peer_token=peer_token), registry=CollectorRegistry(),
                                     transports=(Transport.GRPC_STREAM,))
        self.server = GrpcServer(client_token=client_token, peer_token=peer_token)
        self.server.add(self.node)

    async def __aenter__(self) -> "Served":
        await self.node.start()
        await self.server.start("127.0.0.1", 0)
        await self.server.health.open(self.server)  # SERVING, as a daemon's gate opens once it is up
        self.address = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.aio.insecure_channel(self.address)
        return self

    async def peer(self) -> tuple[tuple[str, str], ...]:
        """The metadata of a new peer session with this server."""
        return await peer_metadata(self.address, PEER_TOKEN)

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await self.node.stop()

    async def raw(self, method: str, payload: bytes, metadata=()) -> grpc.aio.AioRpcError | list[bytes]:
        """Call ``method`` with ``payload`` as the request's bytes, as a client without the stubs would."""
        try:
            if method == "Pull":
                call = self.channel.unary_stream(SERVICE + method, request_serializer=None, response_deserializer=None)
                return [r async for r in call(payload, timeout=5, metadata=metadata)]
            call = self.channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
            return [await call(payload, timeout=5, metadata=metadata)]
        except grpc.aio.AioRpcError as exc:
            return exc


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


def _heartbeat() -> bytes:
    return pb.HeartbeatRequest(engine_id="anyone").SerializeToString()


# two credentials ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("presented", [CLIENT_TOKEN, None, "not-a-token", PEER_TOKEN],
                         ids=["client-token", "no-token", "wrong", "peer-token-in-clear"])
def test_only_a_peer_session_opens_the_prefill_service(method, presented):
    async def main():
        async with Served() as served:
            request = {"Handshake": pb.HandshakeRequest(engine_id="intruder"),
                       "Prefill": pb.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3], engine_id="intruder"),
                       "Pull": pb.PullRequest(grant_id="g", engine_id="intruder"),
                       "Release": pb.ReleaseRequest(grant_id="g", engine_id="intruder"),
                       "Heartbeat": pb.HeartbeatRequest(engine_id="intruder")}[method].SerializeToString()
            refused = await served.raw(method, request, auth_metadata(presented))
            assert isinstance(refused, grpc.aio.AioRpcError), refused
            assert refused.code() is grpc.StatusCode.UNAUTHENTICATED
            assert "needs the peer-token" in refused.details()
            assert served.node.grants_held == 0 and served.cache.free_blocks == 8
            assert "intruder" not in served.node.engines
            # the same call in a session proved through PeerAuth gets past auth (to the service's own answer)
            answered = await served.raw(method, request, await served.peer())
            assert not isinstance(answered, grpc.aio.AioRpcError) or \
                answered.code() is not grpc.StatusCode.UNAUTHENTICATED, answered
    run(main())


def test_health_is_open_and_reflection_takes_a_peer_session_only():
    async def main():
        async with Served() as served:
            health = health_pb2_grpc.HealthStub(served.channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=pb.SERVICE_NAME), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(served.channel)
            ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in reflect.ServerReflectionInfo(iter(ask), timeout=5, metadata=auth_metadata(CLIENT_TOKEN)):
                    pass
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in reflect.ServerReflectionInfo(iter(ask), timeout=5, metadata=auth_metadata(PEER_TOKEN)):
                    pass
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
            names = [s.name async for r in reflect.ServerReflectionInfo(iter(ask), timeout=5,
                                                                        metadata=await served.peer())
                     for s in r.list_services_response.service]
            assert pb.SERVICE_NAME in names and "kpoolpd.v1.PeerAuth" in names
    run(main())


def test_one_token_for_both_credentials_is_refused():
    with pytest.raises(ValueError, match="must differ"):
        GrpcServer(client_token="same", peer_token="same")


# the schemes ------------------------------------------------------------------------------
@pytest.mark.parametrize("header,accepted", [
    (f"Bearer {CLIENT_TOKEN}", True), (f"bearer {CLIENT_TOKEN}", True), (f"BEARER {CLIENT_TOKEN}", True),
    (f"bEaReR   {CLIENT_TOKEN}", True), (f"Basic {CLIENT_TOKEN}", False), (CLIENT_TOKEN, False),
    (f"Bearer {CLIENT_TOKEN}x", False), (f"Bearer {CLIENT_TOKEN[:-1]}", False), ("Bearer ", False),
], ids=["canonical", "lower", "upper", "mixed-and-spaces", "basic", "no-scheme", "longer", "shorter", "empty"])
def test_the_bearer_scheme_is_case_insensitive_and_the_token_exact(header, accepted):
    assert (presented_token([("authorization", header)]) == CLIENT_TOKEN) is accepted


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "KpoolPd-Peer"])
def test_the_peer_token_is_refused_in_clear_in_any_scheme(scheme):
    async def main():
        async with Served() as served:
            got = await served.raw("Heartbeat", _heartbeat(), (("authorization", f"{scheme} {PEER_TOKEN}"),))
            assert isinstance(got, grpc.aio.AioRpcError) and got.code() is grpc.StatusCode.UNAUTHENTICATED, got
            if scheme.lower() == "bearer":  # the refusal says how to get in
                assert "PeerAuth/Challenge" in got.details() and "needs the peer-token" in got.details()
    run(main())


SESSION = "ab" * 32 + "." + "cd" * 32


@pytest.mark.parametrize("header,parsed", [
    (f"KpoolPd-Peer {SESSION}", True), (f"kpoolpd-peer {SESSION}", True), (f"KPOOLPD-PEER   {SESSION}", True),
    (f"KpoolPd-Peer {SESSION.upper()}", True), (f"Bearer {SESSION}", False), (SESSION, False),
    (f"KpoolPd-Peer {SESSION}ab", False), (f"KpoolPd-Peer {SESSION[:-2]}", False),
    (f"KpoolPd-Peer {SESSION.replace('.', '')}", False), (f"KpoolPd-Peer {SESSION.replace('a', 'g')}", False),
    ("KpoolPd-Peer ", False),
], ids=["canonical", "lower", "upper-and-spaces", "upper-hex", "bearer", "no-scheme", "longer", "shorter",
        "no-dot", "not-hex", "empty"])
def test_the_peer_scheme_is_case_insensitive_and_its_halves_32_bytes_of_hex(header, parsed):
    got = presented_session([("authorization", header)])
    assert (got == (bytes.fromhex("ab" * 32), bytes.fromhex("cd" * 32))) is parsed
    assert parsed or got is None


# junk bytes --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_junk_request_bytes_answer_invalid_argument_without_a_traceback(method, caplog):
    caplog.set_level(logging.INFO)

    async def main():
        async with Served() as served:
            peer = await served.peer()
            got = await served.raw(method, JUNK, peer)
            assert isinstance(got, grpc.aio.AioRpcError), got
            assert got.code() is grpc.StatusCode.INVALID_ARGUMENT, got
            assert f"malformed request to {SERVICE}{method}" in got.details()
            # without a session, the bytes are not even looked at
            anonymous = await served.raw(method, JUNK)
            assert anonymous.code() is grpc.StatusCode.UNAUTHENTICATED
            # and the server still serves
            fine = await served.raw("Heartbeat", _heartbeat(), peer)
            assert not isinstance(fine, grpc.aio.AioRpcError), fine
    run(main())
    errors = errors_logged(caplog.records)
    assert not errors, errors
    assert not any(r.exc_info for r in own_records(caplog.records))
    assert any("malformed request" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_junk_to_the_health_service_answers_invalid_argument(caplog):
    async def main():
        async with Served() as served:
            call = served.channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                              response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(JUNK, timeout=5)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    run(main())
    assert not errors_logged(caplog.records)


# ports -------------------------------------------------------------------------------------
def test_a_second_server_on_a_served_port_fails_naming_it_and_the_first_still_serves():
    async def main():
        async with Served() as served:
            port = served.server.port
            with pytest.raises(BindError, match=f"port: port {port} on 127.0.0.1 is in use"):
                ensure_bindable("port", "127.0.0.1", port)
            second = GrpcServer(peer_token=PEER_TOKEN)
            with pytest.raises(BindError, match=f"port: port {port} on 127.0.0.1 is in use"):
                await second.start("127.0.0.1", port)
            await second.stop(0)
            for _ in range(5):  # every new connection still reaches the first server
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert served.server.port == port
    run(main())


def test_ensure_bindable_passes_a_free_port_and_skips_any_and_off():
    """A free port passes and stays free (the check binds and lets go); 0 (any port) and -1 (off) are not
    checked, even while a port is in use: only a real port in use is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert ensure_bindable("port", "127.0.0.1", free) is None
    with socket.socket() as again:  # the check left it free
        again.bind(("127.0.0.1", free))
        again.listen()
        assert ensure_bindable("port", "127.0.0.1", 0) is None
        assert ensure_bindable("metrics-port", "127.0.0.1", -1) is None
        with pytest.raises(BindError, match=f"port {free} on 127.0.0.1 is in use"):
            ensure_bindable("port", "127.0.0.1", free)


@pytest.mark.parametrize("presented", [CLIENT_TOKEN, None], ids=["client-token", "no-token"])
def test_a_refused_stream_waits_for_its_first_message_then_answers_unauthenticated(presented):
    # A status sent before the caller's first message went out makes the caller's gRPC fail that write
    # and report INTERNAL in its place (seen in CI on a loaded machine): the refusal waits for the message.
    path = SERVICE + "PullSession"
    message = pb.PullSessionRequest(pull=pb.PullRequest(grant_id="g", engine_id="intruder")).SerializeToString()

    async def main():
        async with Served() as served:
            session = served.channel.stream_stream(path, request_serializer=None, response_deserializer=None)
            late = session(timeout=5, metadata=auth_metadata(presented))
            await asyncio.sleep(0.3)  # a caller whose first message comes late
            assert not late.done(), "the refusal did not wait for the first message"
            await late.write(message)
            await late.done_writing()
            assert await late.code() is grpc.StatusCode.UNAUTHENTICATED
            assert "needs the peer-token" in await late.details()
            silent = session(timeout=5, metadata=auth_metadata(presented))  # one that never writes
            started = asyncio.get_running_loop().time()
            assert await silent.code() is grpc.StatusCode.UNAUTHENTICATED
            assert asyncio.get_running_loop().time() - started < FIRST_MESSAGE_WAIT_S + 2
            for _ in range(20):  # and the usual caller, one message then its half-close
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in session(iter([message]), timeout=5, metadata=auth_metadata(presented)):
                        pass
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, err.value
            assert served.node.grants_held == 0
    run(main())
