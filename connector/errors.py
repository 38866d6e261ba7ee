"""The one exception the connector raises to its callers: a gRPC status code and a message."""

from __future__ import annotations

import grpc


class TransferError(Exception):
    """A failed connector call. ``code`` is the gRPC status (the server's, or the client's own:
    DEADLINE_EXCEEDED, UNAVAILABLE, DATA_LOSS, RESOURCE_EXHAUSTED); ``str()`` is the message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class CacheExhaustedError(Exception):
    """Raised by ``PrefillCache.allocate`` when the pool has too few free blocks or rings;
    the connector answers RESOURCE_EXHAUSTED."""


class EngineUnavailable(Exception):
    """Raised by ``PrefillEngine.prefill`` when the engine cannot take requests now (draining,
    warming up, its device lost); the connector frees what was allocated and answers
    UNAVAILABLE with the message, so that a decode node tries another prefill node."""
