"""One PD request: a prefill instance computes the prompt and keeps its KV (one token, ``do_remote_decode``),
then a decode instance pulls that KV (``do_remote_prefill``, the prefill's ``kv_transfer_params``) and
generates, its answer streamed back to the client as it comes.

Each role's instance is the one with the fewest outstanding requests. One that cannot be reached, times
out, answers 5xx (or, for a prefill, an answer without kv_transfer_params) is marked failed and skipped for
the next; a role's only instance is tried once more after ``retry_pause_s`` unless it timed out. When every
one failed the client's 502 names each with what went wrong. An instance's 4xx is the client's error: it
reaches the client as it is and marks nothing. A pooled connection that closed under a request is not the
instance's failure (``backends.Backends.post`` sends again).

The prefill leaves a grant on the producer until a decode pulls it. When no decode instance answered 200
(each failed, or one refused with 4xx: a refusal comes before any pull) or the request ended otherwise
after the prefill (the client left, the router failed), ``release_grant(params, request_id)`` is awaited so
that the producer frees the blocks at once rather than at the lease's end."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import aiohttp
from aiohttp import web

from kpool_pd.router.backends import Backends
from kpool_pd.router.bodies import (InstanceRefused, RouterError, decode_body, kv_transfer_params_of, prefill_body,
                                    streams)
from kpool_pd.router.instances import Instance, InstancePool
from kpool_pd.router.metrics import Outcome, RouterMetrics
from kpool_pd.router.settings import RouterSettings

logger = logging.getLogger(__name__)

ReleaseGrant = Callable[[dict, str], Awaitable[bool]]  # (the prefill's kv_transfer_params, request id) -> released

_FAILED = (aiohttp.ClientError, TimeoutError)
_STREAM_BROKE = b'data: {"error": {"message": "the decode instance stopped mid-answer", "type": "upstream_error", ' \
                b'"code": 502}}\n\n'
_SCAN_TAIL = 64 * 1024  # the longest partial event kept while scanning a stream


def _describe(error: BaseException, timeout_s: float) -> str:
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class _Attempts:
    """The instances one request tries in a role, each once (a role's only one twice, after a pause,
    unless it timed out), and what went wrong on each."""

    def __init__(self, pool: InstancePool, retry_pause_s: float) -> None:
        self.pool, self.failures = pool, []
        self.timed_out = False
        self._tried: set[str] = set()
        self._pause_s, self._again = retry_pause_s, len(pool.instances) == 1

    async def next(self) -> Instance | None:
        if (instance := self.pool.choose(self._tried)) is not None:
            self._tried.add(instance.url)
            return instance
        if self._again and self.failures and not self.timed_out:
            self._again = False
            await asyncio.sleep(self._pause_s)
            return self.pool.instances[0]
        return None


class _EventScan:
    """A server-sent event stream read as it passes: whether an event carried an error, whether ``[DONE]``
    came (vLLM ends every stream with it, after an error event too)."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.done = False
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        *events, tail = (self._tail + chunk).split(b"\n\n")
        self._tail = tail[-_SCAN_TAIL:]
        for event in events:
            data = event.strip().removeprefix(b"data:").strip()
            if data == b"[DONE]":
                self.done = True
            elif b"error" in data and self.error is None:
                try:
                    parsed = json.loads(data)
                except (ValueError, RecursionError):
                    continue
                if isinstance(parsed, dict) and ("error" in parsed or parsed.get("object") == "error"):
                    self.error = data[:200].decode(errors="replace")


class PdRouter:
    """Sends each request through a prefill and a decode instance over ``backends``; one event loop."""

    def __init__(self, settings: RouterSettings, backends: Backends, prefill: InstancePool, decode: InstancePool,
                 metrics: RouterMetrics, release_grant: ReleaseGrant) -> None:
        self.settings, self.backends, self.metrics = settings, backends, metrics
        self.prefill_pool, self.decode_pool = prefill, decode
        self._release_grant = release_grant
        self._releases: set[asyncio.Task] = set()
        self._prefill_timeout = aiohttp.ClientTimeout(total=settings.prefill_timeout_s,
                                                      sock_connect=settings.connect_timeout_s)
        self._decode_timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s,
                                                     sock_read=settings.decode_timeout_s)

    def _failed(self, attempts: _Attempts, instance: Instance, error: BaseException | str, timeout_s: float,
                request_id: str) -> None:
        why = error if isinstance(error, str) else _describe(error, timeout_s)
        attempts.timed_out = isinstance(error, TimeoutError)
        attempts.pool.failed(instance, why)
        self.metrics.instance_failures.labels(attempts.pool.role.value, instance.url).inc()
        attempts.failures.append(f"{instance.url} ({why})")
        logger.warning("request %s: %s instance %s failed: %s", request_id, attempts.pool.role.value, instance.url,
                       why)

    @staticmethod
    def _exhausted(attempts: _Attempts) -> RouterError:
        return RouterError(HTTPStatus.BAD_GATEWAY,
                           f"every {attempts.pool.role.value} instance failed: " + "; ".join(attempts.failures))

    async def route(self, request: web.Request, path: str, body: dict, headers: dict[str, str], request_id: str,
                    arrived: float) -> tuple[web.StreamResponse, Outcome]:
        """The client's answer and how it went. RouterError (502) when every instance of a role failed;
        InstanceRefused when a prefill instance refused the request (4xx). Releases the prefill's grant
        whenever no decode instance answered 200, whatever the way out (cancellation included)."""
        params = await self.prefill(path, body, headers, request_id)
        answered = [False]
        try:
            response, outcome = await self.decode(request, path, body, params, headers, request_id, arrived,
                                                  answered)
        except asyncio.CancelledError:
            if not answered[0]:
                self._release(params, request_id, "the request was cancelled before a decode answered")
            raise
        except BaseException as error:
            if not answered[0]:
                await self._release(params, request_id, f"no decode answered ({type(error).__name__})")
            raise
        if not answered[0]:
            await self._release(params, request_id, f"the decode instance refused the request: HTTP {response.status}")
        return response, outcome

    def _release(self, params: dict, request_id: str, why: str) -> asyncio.Task:
        """Releases the grant of ``params`` in a task of its own (a cancelled request cannot await it)."""
        logger.info("request %s: releasing the prefill's grant: %s", request_id, why)

        async def release() -> None:
            released = await self._release_grant(params, request_id)
            self.metrics.grants_released.labels(str(bool(released)).lower()).inc()

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return task

    async def close(self) -> None:
        """Waits for grant releases still running (each is bounded by the releaser's own deadline)."""
        if self._releases:
            await asyncio.wait(set(self._releases), timeout=self.settings.connect_timeout_s * 2)

    async def prefill(self, path: str, body: dict, headers: dict[str, str], request_id: str) -> dict:
        """The ``kv_transfer_params`` of a prefill of ``body``. RouterError (502) when every prefill
        instance failed; InstanceRefused when one refused the request (4xx)."""
        attempts, payload, timeout_s = _Attempts(self.prefill_pool, self.settings.retry_pause_s), prefill_body(body), \
            self.settings.prefill_timeout_s
        pool = attempts.pool
        while (instance := await attempts.next()) is not None:
            started = time.perf_counter()
            with pool.outstanding(instance):
                try:
                    async with self.backends.post(instance.url + path, payload, headers, self._prefill_timeout,
                                                  request_id) as answer:
                        raw = await answer.read()
                        status, content_type = answer.status, answer.content_type
                except _FAILED as error:
                    self._failed(attempts, instance, error, timeout_s, request_id)
                    continue
            if 400 <= status < 500:
                logger.info("request %s: prefill instance %s refused it: HTTP %d", request_id, instance.url, status)
                raise InstanceRefused(status, raw, content_type)
            if status != 200:
                self._failed(attempts, instance, f"HTTP {status}: {raw[:200].decode(errors='replace')}", timeout_s,
                             request_id)
                continue
            try:
                params = kv_transfer_params_of(raw)
            except ValueError as error:
                self._failed(attempts, instance, str(error), timeout_s, request_id)
                continue
            pool.succeeded(instance)
            self.metrics.prefill_seconds.observe(time.perf_counter() - started)
            logger.info("request %s: prefilled on %s in %.3f s", request_id, instance.url, time.perf_counter() - started)
            return params
        raise self._exhausted(attempts)

    async def decode(self, request: web.Request, path: str, body: dict, params: dict, headers: dict[str, str],
                     request_id: str, arrived: float, answered: list[bool]) -> tuple[web.StreamResponse, Outcome]:
        """The decode instance's answer to the client (streamed when the client asked for a stream), and
        how it went; ``answered[0]`` is set once a decode instance answered 200 (it pulls the KV). An
        instance's 4xx is returned as it is. RouterError (502) when every decode instance failed before
        answering."""
        attempts, payload, timeout_s = _Attempts(self.decode_pool, self.settings.retry_pause_s), \
            decode_body(body, params), self.settings.decode_timeout_s
        pool = attempts.pool
        while (instance := await attempts.next()) is not None:
            with pool.outstanding(instance):
                try:
                    async with self.backends.post(instance.url + path, payload, headers, self._decode_timeout,
                                                  request_id) as answer:
                        if answer.status >= 500:
                            raw = await answer.read()
                            self._failed(attempts, instance, f"HTTP {answer.status}: "
                                         f"{raw[:200].decode(errors='replace')}", timeout_s, request_id)
                            continue
                        if answer.status != 200:
                            raw = await answer.read()
                            logger.info("request %s: decode instance %s refused it: HTTP %d", request_id,
                                        instance.url, answer.status)
                            return web.Response(status=answer.status, body=raw,
                                                content_type=answer.content_type), Outcome.CLIENT_ERROR
                        answered[0] = True
                        if not streams(body):
                            raw = await answer.read()
                            self.metrics.first_byte_seconds.observe(time.perf_counter() - arrived)
                            pool.succeeded(instance)
                            return web.Response(status=200, body=raw, content_type=answer.content_type), Outcome.OK
                        return await self._relay(request, answer, attempts, instance, request_id, arrived)
                except _FAILED as error:
                    self._failed(attempts, instance, error, timeout_s, request_id)
        raise self._exhausted(attempts)

    async def _relay(self, request: web.Request, answer: aiohttp.ClientResponse, attempts: _Attempts,
                     instance: Instance, request_id: str, arrived: float) -> tuple[web.StreamResponse, Outcome]:
        """Streams ``answer`` (server-sent events) to the client as its bytes arrive. When the decode
        instance breaks off, the client gets an error event and the stream ends (UPSTREAM_ERROR, the
        instance marked failed); a stream that carries an error event or ends without ``[DONE]`` is
        UPSTREAM_ERROR too. When the client goes away (a failed write, or the handler cancelled), closing
        ``answer`` closes its connection, which tells the instance to stop."""
        out = web.StreamResponse(status=200, headers={"Content-Type": answer.headers.get("Content-Type",
                                                                                          "text/event-stream"),
                                                      "Cache-Control": "no-cache"})
        scan, first = _EventScan(), True
        try:
            await out.prepare(request)
            async for chunk in answer.content.iter_any():
                if first:
                    self.metrics.first_byte_seconds.observe(time.perf_counter() - arrived)
                    first = False
                scan.feed(chunk)
                await out.write(chunk)
        except ConnectionResetError:  # the client went away (aiohttp's is a ClientError too)
            logger.info("request %s: the client went away mid-stream; stopping it on %s", request_id, instance.url)
            answer.close()
            return out, Outcome.CLIENT_ERROR
        except asyncio.CancelledError:
            logger.info("request %s: the client went away mid-stream; stopping it on %s", request_id, instance.url)
            answer.close()
            raise
        except _FAILED as error:
            self._failed(attempts, instance, error, self.settings.decode_timeout_s, request_id)
            await out.write(_STREAM_BROKE)
            await out.write_eof()
            return out, Outcome.UPSTREAM_ERROR
        await out.write_eof()
        if scan.error is not None or not scan.done:
            logger.warning("request %s: the decode stream from %s %s", request_id, instance.url,
                           f"carried an error: {scan.error}" if scan.error else "ended without [DONE]")
            return out, Outcome.UPSTREAM_ERROR
        attempts.pool.succeeded(instance)
        return out, Outcome.OK
