"""The peer token's challenge (``proto/kpoolpd/v1/peer_auth.proto``): the proofs, the credential a call
carries, and the prefill node's side (its table of sessions and the ``PeerAuth`` service).

The token never leaves either process. A caller sends 32 random bytes (the client nonce); the server
answers 32 of its own (the server nonce) and ``server_proof``, an HMAC-SHA256 under the token of a label
and both nonces; the caller checks it before it sends anything else. Both then hold the session's
credential, the same HMAC under another label, which every call presents as
``authorization: KpoolPd-Peer <hex server nonce>.<hex credential>`` (``kpool_pd.connector.shared.peer_client`` on
the caller's side, ``kpool_pd.connector.shared.auth.CredentialInterceptor`` on the server's). The two labels
differ, so a server's proofs, which it gives to anyone who asks, never serve as a caller's credential.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import logging
import secrets

import grpc

from kpool_pd.connector._generated.kpoolpd.v1 import peer_auth_pb2 as _pb
from kpool_pd.connector._generated.kpoolpd.v1 import peer_auth_pb2_grpc as _pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "kpoolpd.v1.PeerAuth"
CHALLENGE_METHOD = f"/{SERVICE_NAME}/Challenge"
NONCE_BYTES = 32  # each side's random bytes; the credential and proof are 32 bytes too (SHA-256)
SERVER_LABEL = b"kpoolpd peer server\0"
CLIENT_LABEL = b"kpoolpd peer client\0"
SCHEME = "kpoolpd-peer"  # matched in any case, as Bearer is; sent as ``KpoolPd-Peer``
# The most sessions a server remembers; the least recently used is forgotten first. A session is two 32-byte
# strings (about 250 bytes with the table's own), so a full table holds about 16 MiB. A caller whose session
# was forgotten challenges again (``UNKNOWN_SESSION``): a flood of Challenges costs callers a round trip each.
MAX_PEER_SESSIONS = 65536
# The details of the UNAUTHENTICATED answer to a session the server does not hold (never issued, forgotten, or
# issued by another process): the caller drops its session and challenges again (``peer_client``).
UNKNOWN_SESSION = "unknown peer session: challenge kpoolpd.v1.PeerAuth again"

ChallengeRequest = _pb.ChallengeRequest
ChallengeResponse = _pb.ChallengeResponse
PeerAuthStub = _pb_grpc.PeerAuthStub


def server_proof(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What a server answers a Challenge with: proof that it holds ``token``."""
    return hmac.digest(token.encode(), SERVER_LABEL + client_nonce + server_nonce, hashlib.sha256)


def client_credential(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The session's credential, which the caller presents on every call."""
    return hmac.digest(token.encode(), CLIENT_LABEL + client_nonce + server_nonce, hashlib.sha256)


def peer_authorization(server_nonce: bytes, credential: bytes) -> str:
    """The ``authorization`` value of a call in the session ``server_nonce``."""
    return f"KpoolPd-Peer {server_nonce.hex()}.{credential.hex()}"


def presented_session(metadata) -> tuple[bytes, bytes] | None:
    """The server nonce and credential of the first ``authorization`` entry when its scheme is
    KpoolPd-Peer (any case) and both are 32 bytes in hex, else None."""
    for key, value in metadata or ():
        if key == "authorization":
            if not isinstance(value, str):
                return None
            scheme, _, rest = value.strip().partition(" ")
            nonce, dot, credential = rest.strip().partition(".")
            if scheme.lower() != SCHEME or not dot or len(nonce) != 2 * NONCE_BYTES \
                    or len(credential) != 2 * NONCE_BYTES:
                return None
            try:
                return bytes.fromhex(nonce), bytes.fromhex(credential)
            except ValueError:
                return None
    return None


class SessionCheck(enum.Enum):
    """What a server makes of a presented session."""

    VALID = "valid"
    UNKNOWN = "unknown"  # not in the table: the caller challenges again
    WRONG = "wrong"  # in the table, with another credential: not this token's


class PeerSessions:
    """One server's sessions: each server nonce it issued and the credential that goes with it, at most
    ``capacity`` of them, the least recently used forgotten first. Used on the server's event loop only
    (the Challenge handler and the interceptor); nothing here waits."""

    def __init__(self, token: str, *, capacity: int = MAX_PEER_SESSIONS) -> None:
        if not isinstance(token, str) or not token.strip():
            raise ValueError("the peer token must be a non-empty string")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self._token = token
        self.capacity = capacity
        self._sessions: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # nonce -> credential
        self.issued = 0  # Challenges answered (diagnosis and tests)

    def __len__(self) -> int:
        return len(self._sessions)

    def challenge(self, client_nonce: bytes) -> tuple[bytes, bytes]:
        """A new session for ``client_nonce``: its server nonce and the server's proof. ValueError for a
        nonce of another length than ``NONCE_BYTES``."""
        if not isinstance(client_nonce, bytes) or len(client_nonce) != NONCE_BYTES:
            size = len(client_nonce) if isinstance(client_nonce, (bytes, bytearray)) else type(client_nonce).__name__
            raise ValueError(f"client_nonce must be {NONCE_BYTES} bytes, got {size}")
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        self._sessions[server_nonce] = client_credential(self._token, client_nonce, server_nonce)
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)
        self.issued += 1
        return server_nonce, server_proof(self._token, client_nonce, server_nonce)

    def check(self, server_nonce: bytes, credential: bytes) -> SessionCheck:
        """Whether ``credential`` is the session's (compared in constant time); a valid session becomes the
        most recently used."""
        expected = self._sessions.get(server_nonce)
        if expected is None:
            return SessionCheck.UNKNOWN
        if not hmac.compare_digest(expected, credential):
            return SessionCheck.WRONG
        self._sessions.move_to_end(server_nonce)
        return SessionCheck.VALID


class PeerAuthServicer(_pb_grpc.PeerAuthServicer):
    """``kpoolpd.v1.PeerAuth`` over one server's ``PeerSessions``. ``runtime.GrpcServer`` registers it
    itself when it guards a service with the peer token; its one RPC needs no credential."""

    service_name = SERVICE_NAME

    def __init__(self, sessions: PeerSessions) -> None:
        self.sessions = sessions

    def add_to_server(self, server: grpc.aio.Server) -> None:
        _pb_grpc.add_PeerAuthServicer_to_server(self, server)

    async def Challenge(self, request: ChallengeRequest, context) -> ChallengeResponse:
        try:
            server_nonce, proof = self.sessions.challenge(request.client_nonce)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return ChallengeResponse(server_nonce=server_nonce, server_proof=proof)
