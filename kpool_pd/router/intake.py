"""How the router takes in client connections: a deadline on each request's headers and a cap on the
connections held, which aiohttp's server does not have (its keep-alive timeout starts only after a first
answer, so a connection that never completes a request line is held for ever).

``ClientGuard.protocol_factory`` wraps each connection's aiohttp ``RequestHandler`` in a small protocol
that passes the transport's calls on and tells the guard when bytes arrive; the guard's ``middleware``
tells it when a request's headers were complete (its handler runs) and when it was answered. A connection
is *waiting* from its opening, or from the first byte after an answer, until its request's headers are
complete; then *busy* until the handler returns; then *idle* (keep-alive, bounded by aiohttp's own
keep-alive timeout). A waiting connection past ``header_timeout_s`` gets 408 and is closed. Past
``max_connections`` the oldest connection without a complete request (waiting or idle) is closed, the new
one included when every other is busy. A request's body is bounded by the handler (``body_timeout_s``)."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

logger = logging.getLogger(__name__)

_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class DropReason(enum.Enum):
    HEADER_DEADLINE = "header_deadline"
    OVER_LIMIT = "over_limit"


class _Watched(asyncio.Protocol):
    """One client connection: aiohttp's handler does the work; the guard sees it open, read and close."""

    __slots__ = ("guard", "handler", "transport", "busy", "deadline")

    def __init__(self, guard: ClientGuard, handler: web.RequestHandler) -> None:
        self.guard, self.handler = guard, handler
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.deadline: asyncio.TimerHandle | None = None  # armed while waiting for a request's headers

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.handler.connection_made(transport)
        self.guard._opened(self)

    def data_received(self, data: bytes) -> None:
        if not self.busy and self.deadline is None:
            self.guard._arm(self)
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard._closed(self)
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class ClientGuard:
    """The client connections of one server. ``dropped`` is called with each drop's reason (metrics).
    One event loop; not thread-safe."""

    def __init__(self, *, header_timeout_s: float, max_connections: int,
                 dropped: Callable[[DropReason], None] = lambda reason: None) -> None:
        self._header_timeout_s, self._max = header_timeout_s, max_connections
        self._dropped = dropped
        self._open: dict[_Watched, None] = {}  # in the order they opened
        self._by_handler: dict[web.RequestHandler, _Watched] = {}

    def __len__(self) -> int:
        return len(self._open)

    def waiting(self) -> int:
        """Connections whose request's headers are not complete."""
        return sum(w.deadline is not None for w in self._open)

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """For ``loop.create_server``: each connection's protocol, watched."""
        return lambda: _Watched(self, server())

    @property
    def middleware(self) -> Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]],
                                     Awaitable[web.StreamResponse]]:
        """The app's middleware marking a connection busy while its request is handled."""
        @web.middleware
        async def watch(request: web.Request, handler) -> web.StreamResponse:
            watched = self._by_handler.get(request.protocol)
            if watched is None:  # served without protocol_factory (aiohttp's own runner)
                return await handler(request)
            watched.busy = True
            self._disarm(watched)
            try:
                return await handler(request)
            finally:
                watched.busy = False
        return watch

    def _opened(self, watched: _Watched) -> None:
        self._open[watched] = None
        self._by_handler[watched.handler] = watched
        self._arm(watched)
        if len(self._open) > self._max:
            victim = next((w for w in self._open if not w.busy), watched)
            self._drop(victim, DropReason.OVER_LIMIT)

    def _arm(self, watched: _Watched) -> None:
        loop = asyncio.get_running_loop()
        watched.deadline = loop.call_later(self._header_timeout_s, self._expired, watched)

    def _disarm(self, watched: _Watched) -> None:
        if watched.deadline is not None:
            watched.deadline.cancel()
            watched.deadline = None

    def _expired(self, watched: _Watched) -> None:
        watched.deadline = None
        if not watched.busy and watched in self._open:
            watched.transport.write(_REQUEST_TIMEOUT)
            self._drop(watched, DropReason.HEADER_DEADLINE)

    def _drop(self, watched: _Watched, reason: DropReason) -> None:
        logger.debug("closing a client connection: %s", reason.value)
        self._closed(watched)
        watched.transport.close()
        self._dropped(reason)

    def _closed(self, watched: _Watched) -> None:
        self._disarm(watched)
        self._open.pop(watched, None)
        self._by_handler.pop(watched.handler, None)
