"""The exceptions the connector and the daemons raise to their callers."""

from __future__ import annotations

import grpc

from kvcache import CacheExhaustedError  # the node cache's: the connector answers it RESOURCE_EXHAUSTED

__all__ = ["CacheExhaustedError", "EngineUnavailable", "StatusError", "rpc_failure", "status_code"]


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
