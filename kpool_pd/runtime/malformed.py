"""Requests whose bytes do not parse: INVALID_ARGUMENT, not UNKNOWN.

grpc.aio deserializes a request before the servicer runs; when that raises (bytes that are not the
method's protobuf message), it answers UNKNOWN and logs an ERROR with a traceback, as if the
server were at fault. ``MalformedRequestInterceptor`` wraps every method's request deserializer so
that it hands the servicer a marker instead of raising, and the servicer's behaviour so that the
marker is answered INVALID_ARGUMENT ("malformed request to <method>: ...") with one warning line.
Stream requests are checked message by message as the servicer reads them.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import grpc

logger = logging.getLogger(__name__)


class _Malformed:
    """What the wrapped deserializer returns for bytes that do not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or whatever a custom deserializer raises
            return _Malformed(f"{type(exc).__name__}: {exc}")
    return parse


async def _refuse(method: str, request: _Malformed, context) -> None:
    logger.warning("malformed request to %s refused: %s", method, request.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request to {method}: {request.reason}")


def _checked_requests(method: str, requests, context):
    async def checked():
        async for request in requests:
            if isinstance(request, _Malformed):
                await _refuse(method, request, context)
            yield request
    return checked()


def _wrap(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with a lenient deserializer and a behaviour that refuses the marker; each
    behaviour keeps its form (coroutine, async generator, or coroutine using ``context.write``)."""
    behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    streams_out = bool(handler.unary_stream or handler.stream_stream)
    if inspect.isasyncgenfunction(behavior):
        async def checked(request, context):
            request = await _accept(method, request, context, handler.request_streaming)
            async for response in behavior(request, context):
                yield response
    elif inspect.iscoroutinefunction(behavior):
        async def checked(request, context):
            request = await _accept(method, request, context, handler.request_streaming)
            return await behavior(request, context)
    else:  # a synchronous behaviour runs on grpc's thread pool; left as it is
        return handler
    kwargs = dict(request_deserializer=_lenient(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
    if handler.request_streaming:
        make = grpc.stream_stream_rpc_method_handler if streams_out else grpc.stream_unary_rpc_method_handler
    else:
        make = grpc.unary_stream_rpc_method_handler if streams_out else grpc.unary_unary_rpc_method_handler
    return make(checked, **kwargs)


async def _accept(method: str, request, context, streaming: bool):
    """The request (a stream: one that checks each message as it is read), or the call aborted."""
    if streaming:
        return _checked_requests(method, request, context)
    if isinstance(request, _Malformed):
        await _refuse(method, request, context)
    return request


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to a request whose bytes do not parse (see the module docstring).
    Place it after the auth interceptor: an unauthenticated caller's bytes are then never parsed
    into a reply other than UNAUTHENTICATED."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _wrap(handler_call_details.method, handler)
