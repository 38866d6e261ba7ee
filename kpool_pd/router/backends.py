"""The router's HTTP client toward its instances: a pool of keep-alive connections, and a retry for the
race a pool of them runs with the instance's own idle timeout.

vLLM's server closes a connection idle for 5 s. A pooled connection the instance is closing as the router
picks it fails the router's write (broken pipe, reset) or its wait for the answer (server disconnected)
before any byte of an answer came: no request reached the instance's handler, so ``send`` sends it once
more, on a fresh connection, and the instance is not to blame. Keeping the pool's idle time under the
instance's (``backend_keepalive_s``, default 4 s) makes the race rare; the retry covers what is left."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp

logger = logging.getLogger(__name__)


def _closed_before_answer(error: BaseException) -> bool:
    """A pooled connection that ended before a byte of an answer: a failed write (not a failed connect),
    or a disconnect with no partial status line or headers (aiohttp then names no partial message)."""
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return isinstance(error.message, str)
    return isinstance(error, aiohttp.ClientOSError) and not isinstance(error, aiohttp.ClientConnectorError)


async def _on_reuse(session: aiohttp.ClientSession, context: SimpleNamespace, params: object) -> None:
    if context.trace_request_ctx is not None:
        context.trace_request_ctx.reused = True


class Backends:
    """Two ``aiohttp.ClientSession``: a pooled one (idle connections kept ``keepalive_s``) for requests and
    a fresh-connection one for a retry and for health probes. Open with ``async with``; one event loop."""

    def __init__(self, *, keepalive_s: float) -> None:
        self._keepalive_s = keepalive_s
        self._stack = contextlib.AsyncExitStack()
        self.pooled: aiohttp.ClientSession | None = None
        self.fresh: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Backends:
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_on_reuse)
        self.pooled = await self._stack.enter_async_context(aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_s), trace_configs=[reuse]))
        self.fresh = await self._stack.enter_async_context(aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True)))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    @contextlib.asynccontextmanager
    async def post(self, url: str, payload: dict, headers: dict[str, str], timeout: aiohttp.ClientTimeout,
                   request_id: str) -> AsyncIterator[aiohttp.ClientResponse]:
        """The instance's answer to ``payload`` (JSON) while the block runs; on a pooled connection that
        closed before any answer, sent once more on a fresh one. Raises aiohttp.ClientError or
        TimeoutError as aiohttp does."""
        async with self.send("POST", url, json.dumps(payload).encode(), headers, timeout, request_id) as answer:
            yield answer

    @contextlib.asynccontextmanager
    async def send(self, method: str, url: str, data: bytes | None, headers: dict[str, str],
                   timeout: aiohttp.ClientTimeout, request_id: str) -> AsyncIterator[aiohttp.ClientResponse]:
        """The instance's answer to ``method`` on ``url`` (``data``: a JSON body, or None for none) while the
        block runs, with ``post``'s retry on a pooled connection that closed before any answer. Raises
        aiohttp.ClientError or TimeoutError as aiohttp does."""
        if data is not None:
            headers = headers | {"Content-Type": "application/json"}
        attempt = SimpleNamespace(reused=False)
        try:
            answer = await self.pooled.request(method, url, data=data, headers=headers, timeout=timeout,
                                               trace_request_ctx=attempt)
        except aiohttp.ClientError as error:
            if not (attempt.reused and _closed_before_answer(error)):
                raise
            logger.info("request %s: the pooled connection to %s closed before an answer (%s); sending again on a "
                        "fresh connection", request_id, url, type(error).__name__)
            answer = await self.fresh.request(method, url, data=data, headers=headers, timeout=timeout)
        async with answer:
            yield answer
