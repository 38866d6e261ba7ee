"""The two credentials of a deployment: the server's check of each, and the client token's metadata.

A deployment has two credentials, never one:

- the **client** token (``--token``) guards a decode node's public Generate API. Its callers send it
  as ``authorization: Bearer <token>`` (``auth_metadata``); the scheme ``Bearer`` is matched
  case-insensitively (RFC 7235), the token exactly, in constant time.
- the **peer** token (``--peer-token``) guards a prefill node's internal PrefillService, which decode
  nodes call. (With mTLS a prefill node may rely on client certificates alone.) It never leaves the
  process: a caller proves it through ``kpoolpd.v1.PeerAuth/Challenge`` and has the server prove it
  back (``kpool_pd.connector.shared.peer_auth``), then presents the session's credential,
  ``authorization: KpoolPd-Peer <hex server nonce>.<hex credential>``, which ``open_channel`` adds to
  every call of a channel opened with the peer token (``kpool_pd.connector.shared.peer_client``).

Each service a server registers says which credential it requires; one of the other kind is refused
like a wrong one (UNAUTHENTICATED). grpc.health.v1 and PeerAuth need none, so that orchestrator probes
need no secret and a caller can start its session; any other service the server carries (reflection)
takes any credential the server requires.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
from collections.abc import Mapping

import grpc

from kpool_pd.connector.shared.peer_auth import SERVICE_NAME as PEER_AUTH_SERVICE
from kpool_pd.connector.shared.peer_auth import UNKNOWN_SESSION, PeerSessions, SessionCheck, presented_session

HEALTH_PREFIX = "/grpc.health.v1.Health/"
OPEN_PREFIXES = (HEALTH_PREFIX, f"/{PEER_AUTH_SERVICE}/")  # methods that need no credential
SCHEME = "bearer"


class Credential(enum.Enum):
    """Which token a service requires; the value names the daemon option that sets it."""

    CLIENT = "token"  # callers of a decode node's Generate API
    PEER = "peer-token"  # kpool-pd nodes calling each other: a decode node calling a prefill node


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a caller of a client-token API (Generate, a DCP rank's service) sends with ``token``
    (none for None or empty). Never for the peer token, which is proved, not sent (``open_channel``)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def presented_token(metadata) -> str | None:
    """The token of the first ``authorization`` entry when its scheme is Bearer (any case), else None."""
    for key, value in metadata or ():
        if key == "authorization":
            if not isinstance(value, str):
                return None
            scheme, _, token = value.strip().partition(" ")
            return token.strip() if scheme.lower() == SCHEME and token.strip() else None
    return None


class CredentialInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED unless the call presents the credential its service requires.

    ``required`` maps a full service name (``"kpoolpd.v1.PrefillService"``) to its credential: CLIENT
    takes ``Bearer <client_token>``; PEER takes a session of ``peer_sessions`` (``KpoolPd-Peer``), and
    a session that table does not hold is answered with ``UNKNOWN_SESSION`` exactly, on which the
    caller challenges again. A service not in ``required`` (reflection) takes any credential that some
    service requires; health and PeerAuth are always open. The interceptor reads ``required`` at each
    call, so a server may fill it until it starts.

    The peer token itself is not taken as a bearer token, not even from decode nodes of earlier
    releases: a server that took it would keep a token that an older node sent in clear to whatever
    address it was given worth stealing, and a mixed fleet cannot work anyway (a decode node of this
    release refuses a prefill node that does not serve PeerAuth). The refusal says how to get in."""

    def __init__(self, required: Mapping[str, Credential], *, client_token: str | None = None,
                 peer_sessions: PeerSessions | None = None) -> None:
        self._required = required
        self._client_token = client_token
        self._peer_sessions = peer_sessions

    def _refusal_reason(self, credential: Credential, metadata) -> str | None:
        """None when ``metadata`` presents ``credential``, else why not."""
        if credential is Credential.CLIENT:
            presented = presented_token(metadata)
            if presented is None or self._client_token is None:
                return "missing bearer token"
            return None if hmac.compare_digest(presented.encode(), self._client_token.encode()) else "wrong bearer token"
        session = presented_session(metadata)
        if session is None:
            if presented_token(metadata) is not None:
                return ("a bearer token is not taken for the peer token: prove it through "
                        f"{PEER_AUTH_SERVICE}/Challenge and present the session's credential")
            return "missing peer credential"
        if self._peer_sessions is None:
            return UNKNOWN_SESSION
        check = self._peer_sessions.check(*session)
        if check is SessionCheck.VALID:
            return None
        return UNKNOWN_SESSION if check is SessionCheck.UNKNOWN else "wrong peer credential"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata
        service = method.lstrip("/").rpartition("/")[0]
        if service in self._required:
            credential = self._required[service]
            reason = self._refusal_reason(credential, metadata)
            if reason is None:
                return handler
            if reason != UNKNOWN_SESSION:
                reason += f" (this service needs the {credential.value})"
            return _refusal(handler, reason)
        kinds = sorted(set(self._required.values()), key=lambda c: c.value)
        if not kinds:
            return handler
        reasons = [self._refusal_reason(credential, metadata) for credential in kinds]
        if None in reasons:
            return handler
        return _refusal(handler, UNKNOWN_SESSION if UNKNOWN_SESSION in reasons else " or ".join(reasons))


# How long the refusal of a client-streaming call waits for the caller's first message (below).
FIRST_MESSAGE_WAIT_S = 1.0


def _refusal(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover - abort raises

    async def after_first_message(context):
        # A status sent before the caller's first message went out makes the caller's gRPC fail that
        # write and report INTERNAL ("Internal error from Core") in place of this status; so the refusal
        # waits for one message, or the caller's half-close, or FIRST_MESSAGE_WAIT_S, whichever is first.
        # Its bytes are not parsed: this handler has no deserializer.
        try:
            await asyncio.wait_for(context.read(), FIRST_MESSAGE_WAIT_S)
        except Exception:  # the wait ran out, or the read failed: refused the same way
            pass
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def client_stream_unary(request_iterator, context):
        await after_first_message(context)

    async def client_stream_stream(request_iterator, context):
        await after_first_message(context)
        yield  # pragma: no cover - abort raises

    unread = dict(request_deserializer=None, response_serializer=handler.response_serializer)
    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(client_stream_unary, **unread)
    return grpc.stream_stream_rpc_method_handler(client_stream_stream, **unread)
