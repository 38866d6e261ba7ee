"""The exceptions the connector and the daemons raise to their callers."""

from __future__ import annotations

import asyncio

import grpc

from kpool_pd.kvcache import CacheExhaustedError  # the node cache's: the connector answers it RESOURCE_EXHAUSTED

__all__ = ["CacheExhaustedError", "EngineUnavailable", "StatusError", "rpc_failure", "status_code", "status_of"]


class StatusError(Exception):
    """A failed call or request: a gRPC status code and a message for whoever answers it.

    The connector raises it for its own failures (the server's status, or its own
    DEADLINE_EXCEEDED, UNAVAILABLE, DATA_LOSS, RESOURCE_EXHAUSTED); the decode node raises it to
    abort a Generate call with that status. ``str()`` is ``"CODE: message"``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def status_code(value: int) -> grpc.StatusCode:
    """The StatusCode of its wire value (``code.value[0]``), UNKNOWN for a value gRPC does not define."""
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)


def rpc_failure(exc: grpc.aio.AioRpcError, what: str) -> StatusError:
    """The StatusError of a failed call: its code, its details prefixed with ``what`` (the call and the peer)."""
    return StatusError(exc.code(), f"{what}: {exc.details()}")


class EngineUnavailable(Exception):
    """Raised by ``PrefillEngine.prefill`` when the engine cannot take requests now (draining,
    warming up, its device lost); the connector frees what was allocated and answers
    UNAVAILABLE with the message, so that a decode node tries another prefill node."""


def status_of(exc: BaseException, what: str) -> StatusError:
    """The one mapping from an exception to the status its caller is answered with, the message prefixed
    with ``what`` (who failed at what): a StatusError as it is; a failed gRPC call its own code and details;
    ``CacheExhaustedError`` RESOURCE_EXHAUSTED; ``EngineUnavailable`` UNAVAILABLE; ``ValueError`` and
    ``TypeError`` (bad input) INVALID_ARGUMENT; a time-out DEADLINE_EXCEEDED; anything else INTERNAL,
    naming the exception's type. Cancellation is not a status: callers let ``CancelledError`` through."""
    if isinstance(exc, StatusError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        return rpc_failure(exc, what)
    for kinds, code in _CODES:
        if isinstance(exc, kinds):
            return StatusError(code, f"{what}: {exc}")
    return StatusError(grpc.StatusCode.INTERNAL, f"{what}: {type(exc).__name__}: {exc}")


_CODES: tuple[tuple[type | tuple[type, ...], grpc.StatusCode], ...] = (
    (CacheExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineUnavailable, grpc.StatusCode.UNAVAILABLE),
    ((ValueError, TypeError), grpc.StatusCode.INVALID_ARGUMENT),
    ((asyncio.TimeoutError, TimeoutError), grpc.StatusCode.DEADLINE_EXCEEDED),
)
