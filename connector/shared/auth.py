"""Bearer tokens: the two credentials of a deployment, the server's check and the caller's metadata.

A deployment has two credentials, never one:

- the **client** token (``--token``) guards a decode node's public Generate API;
- the **peer** token (``--peer-token``) guards a prefill node's internal PrefillService, which
  decode nodes call. (With mTLS a prefill node may rely on client certificates alone.)

Each service a server registers says which one it requires; a token of the other kind is refused
like a wrong one (UNAUTHENTICATED). grpc.health.v1 needs none, so that orchestrator probes need no
secret; any other service the server carries (reflection) takes any token the server requires.
The scheme ``Bearer`` is matched case-insensitively (RFC 7235); the token exactly, in constant time.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
from collections.abc import Mapping

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
SCHEME = "bearer"


class Credential(enum.Enum):
    """Which token a service requires; the value names the daemon option that sets it."""

    CLIENT = "token"  # callers of a decode node's Generate API
    PEER = "peer-token"  # kpool-pd nodes calling each other: a decode node calling a prefill node


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a caller sends with ``token`` (none for None or empty)."""
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


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED unless the call presents the token its service requires.

    ``required`` maps a full service name (``"kpoolpd.v1.PrefillService"``) to its credential and
    token; a service not in it (reflection) accepts any of those tokens; health is always open.
    The interceptor reads ``required`` at each call, so a server may fill it until it starts."""

    def __init__(self, required: Mapping[str, tuple[Credential, str]]) -> None:
        self._required = required

    def _expected(self, method: str) -> tuple[Credential | None, list[bytes]]:
        service = method.lstrip("/").rpartition("/")[0]
        if service in self._required:
            credential, token = self._required[service]
            return credential, [token.encode()]
        return None, sorted({token.encode() for _, token in self._required.values()})

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        credential, expected = self._expected(method)
        if not expected:
            return handler
        presented = presented_token(handler_call_details.invocation_metadata)
        if presented is not None:
            given = presented.encode()
            matched = False
            for token in expected:  # no early exit: the time does not say which token was close
                matched |= hmac.compare_digest(given, token)
            if matched:
                return handler
        needed = f" (this service needs the {credential.value})" if credential is not None else ""
        reason = f"missing bearer token{needed}" if presented is None else f"wrong bearer token{needed}"
        return _refusal(handler, reason)


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
