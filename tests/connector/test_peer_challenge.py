"""The peer token's challenge (``kpool_pd.connector.shared.peer_auth``, ``kpool_pd.connector.shared.peer_client``), over loopback
sockets: a decode node that dials a server which cannot prove the token sends it nothing but a Challenge,
never the token, and closes the channel; a real prefill node with the token is connected and pulled from in
one session; a wrong token on either side, and a session taken to another server, are refused; a server that
forgot a session (its table full, or a new process on the address) costs no failed unary call; concurrent
first calls share one Challenge; and the session table stays within its bound under a flood of Challenges."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kpool_pd.connector import (MAX_PEER_SESSIONS, ConnectorConfig, DecodeConnector, PrefillConnector, StatusError, Transport,
                       auth_metadata, open_channel, ucx_available)
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.peer_auth import (CHALLENGE_METHOD, NONCE_BYTES, UNKNOWN_SESSION, ChallengeRequest,
                                        ChallengeResponse, PeerAuthStub, PeerSessions, SessionCheck,
                                        client_credential, peer_authorization, server_proof)
from kpool_pd.connector.shared.peer_client import PeerProver
from kpool_pd.kvcache import NodeCache
from kpool_pd.runtime import GrpcServer
from tests.support import connector_procs as procs
from tests.support.connector_harness import InProcessPair
from tests.support.deadlines import patient
from tests.support.peer_credentials import peer_metadata
from tests.support.polling import until
from tests.support.pulls import pull_into
from tests.support.serving import serve_prefill, stop_prefill

GRPC = Transport.GRPC_STREAM
TOKEN = procs.TOKEN  # the token of InProcessPair's prefill node
HEARTBEAT = f"/{pb.SERVICE_NAME}/Heartbeat"
WAIT_S = 10.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(60)))


def holds(predicate):
    """``predicate`` as the coroutine function ``tests.support.polling.until`` polls."""
    async def check() -> bool:
        return predicate()
    return check


def proved_channel(address: str, token: str = TOKEN) -> tuple[grpc.aio.Channel, PeerProver]:
    """A channel made as ``open_channel`` makes one with a peer token, and its prover (the test reads its counts)."""
    prover = PeerProver(token, address, challenge_timeout_s=5.0)
    channel = grpc.aio.insecure_channel(address, interceptors=prover.interceptors)
    prover.bind(channel)
    return channel, prover


# a server that is not a prefill node of this fleet ---------------------------------------------
class FakePeer:
    """A PrefillService-like gRPC server at a loopback address, as a hostile host would run one: it answers
    every method (Handshake with an empty reply, as if it were a prefill node) and records each call's
    method, every metadata entry and the request's bytes; ``address`` is a TCP relay in front of it that
    records every byte a client sends and counts the client connections open. ``prove(client_nonce,
    server_nonce)`` makes its Challenge's proof; None: it does not serve PeerAuth (UNIMPLEMENTED)."""

    def __init__(self, prove=None) -> None:
        self.prove = prove
        self.methods: list[str] = []
        self.metadata: list[tuple[str, object]] = []
        self.messages: list[bytes] = []
        self.raw = bytearray()
        self.accepted = 0
        self.open_connections = 0
        self._tasks: set[asyncio.Task] = set()  # the relay's handlers and pumps
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> "FakePeer":
        fake = self

        class Everything(grpc.GenericRpcHandler):
            def service(self, details):
                fake.methods.append(details.method)
                fake.metadata.extend(details.invocation_metadata)
                if details.method == CHALLENGE_METHOD:
                    return None if fake.prove is None else grpc.unary_unary_rpc_method_handler(fake._challenge)
                return grpc.unary_unary_rpc_method_handler(fake._anything)

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((Everything(),))
        self._grpc_port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.relay = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.relay.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.relay.close()
        for writer in self._writers:  # every relayed connection ends: its handler returns (never cancelled)
            writer.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=WAIT_S)
        await self.server.stop(0)

    async def _challenge(self, request: bytes, context) -> bytes:
        self.messages.append(request)
        client_nonce = ChallengeRequest.FromString(request).client_nonce
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        return ChallengeResponse(server_nonce=server_nonce,
                                 server_proof=self.prove(client_nonce, server_nonce)).SerializeToString()

    async def _anything(self, request: bytes, context) -> bytes:
        self.messages.append(request)
        return b""

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open_connections += 1
        self._tasks.add(asyncio.current_task())
        self._writers.append(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._grpc_port)
        except OSError:
            self.open_connections -= 1
            writer.close()
            return
        self._writers.append(up_writer)
        back = asyncio.ensure_future(self._pump(up_reader, writer, record=False))
        self._tasks.add(back)
        try:
            await self._pump(reader, up_writer, record=True)
        finally:
            self.open_connections -= 1  # the client's side ended (EOF or reset)
            for w in (up_writer, writer):
                w.close()
            await asyncio.wait([back], timeout=WAIT_S)  # ends with the connections just closed

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, record: bool) -> None:
        try:
            while data := await reader.read(65536):
                if record:
                    self.raw += data
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass

    def received(self, needle: bytes) -> bool:
        """Whether ``needle`` was in any byte a client sent: raw, a metadata entry or a request."""
        entries = [f"{k}: {v}".encode() if isinstance(v, str) else k.encode() + b": " + v for k, v in self.metadata]
        return any(needle in blob for blob in (bytes(self.raw), *entries, *self.messages))


def _decode_node(token: str, transports=(GRPC,)) -> DecodeConnector:
    cache = NodeCache(procs.CONFIG, num_blocks=8, num_rings=2)
    return DecodeConnector(cache.pool, engine_id="decode-t", registry=CollectorRegistry(), transports=transports,
                           config=ConnectorConfig(peer_token=token, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5)))


ANOTHER_TOKEN = "another-fleet's-token"
PROOFS = {
    "no-peer-auth": None,
    "wrong-proof": lambda client_nonce, server_nonce: secrets.token_bytes(32),
    "another-token": lambda client_nonce, server_nonce: server_proof(ANOTHER_TOKEN, client_nonce, server_nonce),
    "echoed-nonce": lambda client_nonce, server_nonce: client_nonce,
}


@pytest.mark.parametrize("transports", [(GRPC,), (Transport.UCX, GRPC)], ids=["grpc", "ucx"])
@pytest.mark.parametrize("proof", list(PROOFS))
def test_a_peer_that_does_not_prove_the_token_gets_only_a_challenge_and_its_channel_is_closed(proof, transports):
    if Transport.UCX in transports and not ucx_available():
        pytest.skip("UCX is not available here")

    async def main():
        async with FakePeer(PROOFS[proof]) as fake:
            decode = await _decode_node(TOKEN, transports).start()
            try:
                with pytest.raises(StatusError) as err:
                    await decode.connect(fake.address)
                assert err.value.code is grpc.StatusCode.UNAUTHENTICATED, err.value
                assert f"peer {fake.address} did not prove the peer token" in err.value.message, err.value
                assert decode.peers == ()  # no peer, so no keep-alive to it
                # the channel was closed: the relay saw the decode node's connection end
                await until(holds(lambda: fake.accepted >= 1 and fake.open_connections == 0),
                            "the decode node's connection to the fake peer ending", WAIT_S)
            finally:
                await decode.close()
            assert fake.methods == [CHALLENGE_METHOD], fake.methods  # nothing but the Challenge: no Handshake
            assert not fake.received(TOKEN.encode()), "the peer token reached the fake peer"
            assert not [k for k, _ in fake.metadata if k == "authorization"], fake.metadata
    run(main())


def test_a_peer_that_proves_the_token_gets_the_session_credential_on_every_call_and_never_the_token():
    """The same fake, knowing the token: the Handshake goes out, carrying the session's credential (a caller's
    own ``authorization`` entry replaced); the empty reply is refused as another layout."""
    async def main():
        async with FakePeer(lambda cn, sn: server_proof(TOKEN, cn, sn)) as fake:
            decode = await _decode_node(TOKEN).start()
            try:
                with pytest.raises(StatusError) as err:
                    await decode.connect(fake.address)
                assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION, err.value
                channel, prover = proved_channel(fake.address)
                async with channel:
                    await pb.PrefillServiceStub(channel).Heartbeat(pb.HeartbeatRequest(engine_id="e"), timeout=5,
                                                                   metadata=auth_metadata(TOKEN))
                    assert prover.challenges == 1
            finally:
                await decode.close()
            assert fake.methods == [CHALLENGE_METHOD, f"/{pb.SERVICE_NAME}/Handshake", CHALLENGE_METHOD, HEARTBEAT]
            authorizations = [v for k, v in fake.metadata if k == "authorization"]
            assert len(authorizations) == 2 and all(v.startswith("KpoolPd-Peer ") for v in authorizations)
            challenges = [ChallengeRequest.FromString(m).client_nonce for m in fake.messages[0::2]]
            assert all(len(nonce) == NONCE_BYTES for nonce in challenges) and challenges[0] != challenges[1]
            assert not fake.received(TOKEN.encode()), "the peer token reached the fake peer"
    run(main())


# a real prefill node ---------------------------------------------------------------------------
def test_a_prefill_node_with_the_token_is_connected_and_pulled_from_in_one_session():
    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            grant = await peer.prefill("one-session", [3] * 130)
            with await pull_into(pair.d_cache, peer, grant, transport=GRPC, integrity=True) as landed:
                assert landed.nbytes > 0
            assert await peer.heartbeat([]) == []
            assert pair.server.peer_sessions.issued == 1 and len(pair.server.peer_sessions) == 1
            assert pair.free() == start
    run(main())


WRONG_TOKENS = ["decode-node-with-another-token", "prefill-node-with-another-token", "caller-that-skips-the-proof"]


@pytest.mark.parametrize("case", WRONG_TOKENS)
def test_a_wrong_token_on_either_side_is_refused(case):
    """Another token on the decode node, or on the prefill node: the decode node finds the proof wrong and sends
    no Handshake. A caller with another token that sends its credential without checking the proof: the prefill
    node refuses it. Neither side's engine is known to the prefill node afterwards."""
    prefill_token = ANOTHER_TOKEN if case == "prefill-node-with-another-token" else TOKEN
    config = ConnectorConfig(peer_token=prefill_token, rpc_timeout_s=patient(5), transfer_timeout_s=patient(5))

    async def main():
        async with InProcessPair(config=config) as pair:
            if case != "caller-that-skips-the-proof":
                decode = await _decode_node(ANOTHER_TOKEN if case == "decode-node-with-another-token" else TOKEN).start()
                try:
                    with pytest.raises(StatusError) as err:
                        await decode.connect(pair.address)
                    assert decode.peers == ()
                finally:
                    await decode.close()
                assert err.value.code is grpc.StatusCode.UNAUTHENTICATED, err.value
                assert f"peer {pair.address} did not prove the peer token" in err.value.message, err.value
            else:
                client_nonce = secrets.token_bytes(NONCE_BYTES)
                async with grpc.aio.insecure_channel(pair.address) as channel:
                    r = await PeerAuthStub(channel).Challenge(ChallengeRequest(client_nonce=client_nonce), timeout=5)
                    forged = client_credential(ANOTHER_TOKEN, client_nonce, r.server_nonce)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await pb.PrefillServiceStub(channel).Handshake(
                            pb.HandshakeRequest(engine_id="intruder"), timeout=5,
                            metadata=(("authorization", peer_authorization(r.server_nonce, forged)),))
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "wrong peer credential" in refused.value.details()
            assert pair.prefill.engines.get("intruder") is None and pair.prefill.engines.get("decode-t") is None
    run(main())


def test_a_session_taken_to_another_server_with_the_same_token_is_refused():
    async def main():
        async with InProcessPair() as first, InProcessPair() as second:
            session = await peer_metadata(first.address, TOKEN)
            request = pb.HeartbeatRequest(engine_id="anyone")
            for pair, accepted in ((first, True), (second, False)):
                async with grpc.aio.insecure_channel(pair.address) as channel:
                    call = pb.PrefillServiceStub(channel).Heartbeat(request, timeout=5, metadata=session)
                    if accepted:
                        assert (await call).lease_ms > 0
                    else:
                        with pytest.raises(grpc.aio.AioRpcError) as refused:
                            await call
                        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                        assert refused.value.details() == UNKNOWN_SESSION
    run(main())


# forgotten sessions ----------------------------------------------------------------------------
async def _flood(address: str, n: int, *, batch: int = 64) -> None:
    """``n`` Challenges, ``batch`` at a time, from strangers (no proof checked)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = PeerAuthStub(channel)
        for start in range(0, n, batch):
            await asyncio.gather(*[stub.Challenge(ChallengeRequest(client_nonce=secrets.token_bytes(NONCE_BYTES)),
                                                  timeout=WAIT_S) for _ in range(min(batch, n - start))])


def test_an_evicted_session_costs_no_failed_unary_call():
    async def main():
        async with InProcessPair(max_peer_sessions=4) as pair:
            sessions = pair.server.peer_sessions
            peer = await pair.decode.connect(pair.address)
            await _flood(pair.address, 8)  # the decode node's session is the least recently used: forgotten
            assert sessions.issued == 9 and len(sessions) == 4
            grant = await peer.prefill("after-eviction", [5] * 70)  # refused once, challenged, sent again
            assert sessions.issued == 10
            with await pull_into(pair.d_cache, peer, grant, transport=GRPC) as landed:
                assert landed.nbytes > 0
            assert sessions.issued == 10  # the pull went in the new session
    run(main())


def test_a_unary_call_is_sent_again_once_and_a_stream_fails_then_the_next_call_challenges():
    async def main():
        async with InProcessPair(max_peer_sessions=2) as pair:
            channel, prover = proved_channel(pair.address)
            async with channel:
                stub = pb.PrefillServiceStub(channel)
                heartbeat = pb.HeartbeatRequest(engine_id="anyone")
                assert (await stub.Heartbeat(heartbeat, timeout=5)).lease_ms > 0
                first = prover.session
                await _flood(pair.address, 2)
                assert (await stub.Heartbeat(heartbeat, timeout=5)).lease_ms > 0  # no failure seen
                assert prover.challenges == 2 and prover.session not in (None, first)
                await _flood(pair.address, 2)
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # a stream fails as refused ...
                    async for _ in stub.Pull(pb.PullRequest(grant_id="g", engine_id="anyone"), timeout=5):
                        pass
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert refused.value.details() == UNKNOWN_SESSION
                await until(holds(lambda: prover.session is None), "the forgotten session dropped", WAIT_S)
                with pytest.raises(grpc.aio.AioRpcError) as answered:  # ... and the next one challenges again
                    async for _ in stub.Pull(pb.PullRequest(grant_id="g", engine_id="anyone"), timeout=5):
                        pass
                assert answered.value.code() is not grpc.StatusCode.UNAUTHENTICATED, answered.value
                assert prover.challenges == 3
    run(main())


def test_a_prefill_node_restarted_under_a_decode_node_comes_back_on_the_same_channel():
    async def main():
        async with InProcessPair() as pair:
            start = pair.free()
            peer = await pair.decode.connect(pair.address)
            port = pair.server.port
            await stop_prefill(pair.server, pair.prefill)
            pair.prefill = PrefillConnector(pair.p_cache.pool, procs.SeededFillEngine(pair.p_cache),
                                            engine_id="prefill-restarted", config=pair.prefill.config,
                                            registry=CollectorRegistry(), transports=(GRPC,))
            pair.server = await serve_prefill(pair.prefill, port=port)
            await asyncio.wait_for(peer._channel.channel_ready(), WAIT_S)
            # the keep-alive's next beat: its Heartbeat is challenged again and sent once more, the new node
            # does not know the engine, and the engine handshakes again on the same channel
            await peer.keep_alive.beat()
            assert pair.server.peer_sessions.issued == 1
            assert pair.prefill.engines.get(pair.decode.engine_id) is not None
            grant = await peer.prefill("after-restart", [4] * 130)
            with await pull_into(pair.d_cache, peer, grant, transport=GRPC, integrity=True) as landed:
                assert landed.nbytes > 0
            assert pair.free() == start
    run(main())


def test_concurrent_first_calls_share_one_challenge():
    async def main():
        async with InProcessPair() as pair:
            channel, prover = proved_channel(pair.address)
            async with channel:
                stub = pb.PrefillServiceStub(channel)
                replies = await asyncio.gather(*[stub.Heartbeat(pb.HeartbeatRequest(engine_id=f"e{i}"), timeout=5)
                                                 for i in range(16)])
                assert all(r.lease_ms > 0 for r in replies)
                assert prover.challenges == 1 and pair.server.peer_sessions.issued == 1
    run(main())


# the table and the Challenge itself ------------------------------------------------------------
def test_the_session_table_stays_within_its_bound_under_a_flood_and_keeps_a_session_in_use():
    async def main():
        async with InProcessPair(max_peer_sessions=32) as pair:
            sessions = pair.server.peer_sessions
            peer = await pair.decode.connect(pair.address)
            for _ in range(10):
                await _flood(pair.address, 16)
                assert len(sessions) <= 32
                assert await peer.heartbeat([]) == []  # used between floods: never the least recently used
            assert len(sessions) == 32 and sessions.issued == 161
    run(main())


def test_a_server_keeps_at_most_max_peer_sessions_and_refuses_a_bound_below_one():
    async def main():  # a server is made on its event loop
        assert GrpcServer(peer_token=TOKEN).peer_sessions.capacity == MAX_PEER_SESSIONS
        assert GrpcServer(peer_token=TOKEN, max_peer_sessions=7).peer_sessions.capacity == 7
        assert GrpcServer(client_token=TOKEN).peer_sessions is None  # no peer token: no sessions, no PeerAuth
        for bad in (0, -1, 1.5, "8", True):
            with pytest.raises(ValueError) as err:
                GrpcServer(peer_token=TOKEN, max_peer_sessions=bad)
            assert f"max_peer_sessions must be a positive integer, got {bad!r}" in str(err.value)
    run(main())


def test_the_table_forgets_the_least_recently_used_session():
    table = PeerSessions(TOKEN, capacity=3)
    issued = []
    for _ in range(3):
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        server_nonce, proof = table.challenge(client_nonce)
        assert proof == server_proof(TOKEN, client_nonce, server_nonce)
        issued.append((server_nonce, client_credential(TOKEN, client_nonce, server_nonce)))
    assert table.check(*issued[0]) is SessionCheck.VALID  # the oldest, used: now the most recent
    table.challenge(secrets.token_bytes(NONCE_BYTES))
    assert len(table) == 3
    assert table.check(*issued[1]) is SessionCheck.UNKNOWN  # the least recently used went
    assert table.check(*issued[0]) is SessionCheck.VALID and table.check(*issued[2]) is SessionCheck.VALID
    assert table.check(issued[0][0], issued[2][1]) is SessionCheck.WRONG
    with pytest.raises(ValueError, match="capacity"):
        PeerSessions(TOKEN, capacity=0)


@pytest.mark.parametrize("size", [0, 1, NONCE_BYTES - 1, NONCE_BYTES + 1, 4 * NONCE_BYTES],
                         ids=["empty", "one", "short", "long", "much-longer"])
def test_a_client_nonce_of_another_length_is_invalid_argument_naming_it(size):
    async def main():
        async with InProcessPair() as pair:
            async with grpc.aio.insecure_channel(pair.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await PeerAuthStub(channel).Challenge(ChallengeRequest(client_nonce=b"\1" * size), timeout=5)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"client_nonce must be {NONCE_BYTES} bytes, got {size}" in err.value.details()
            assert len(pair.server.peer_sessions) == 0
    run(main())


def test_a_channel_refuses_to_be_made_without_a_challenge_deadline():
    with pytest.raises(ValueError, match="challenge_timeout_s"):
        open_channel("127.0.0.1:1", None, peer_token=TOKEN)
    with pytest.raises(ValueError, match="challenge_timeout_s"):
        PeerProver(TOKEN, "127.0.0.1:1", challenge_timeout_s=0)
