"""One PD request: a prefill instance computes the prompt and keeps its KV (one token, ``do_remote_decode``),
then a decode instance pulls that KV (``do_remote_prefill``, the prefill's ``kv_transfer_params``) and
generates, its answer streamed back to the client as it comes. Where decode instances have vLLM engine_ids
(``--decode-engine-id``), the decode instance is chosen before the prefill, named in it (``prefetch_by``: the
producer announces the KV to it, which pulls it early) and tried first.

Each role's instance is chosen by load and by prefix (``instances.InstancePool.choose``): a prefill
instance by its outstanding prompt tokens, a decode instance by its outstanding requests and tokens, and
either where the prompt's longest block-aligned prefix went before unless it is loaded past the margin. One that cannot be reached, times
out, answers 5xx (or, for a prefill, an answer without kv_transfer_params) is marked failed and skipped for
the next; a role's only instance is tried once more after ``retry_pause_s`` unless it timed out
(``attempts``). When every one failed the client's 502 names each with what went wrong. An instance's 4xx
is the client's error: it reaches the client as it is and marks nothing. A pooled connection that closed
under a request is not the instance's failure (``backends.Backends.send`` sends again).

A decode instance that fails a request after its prefill (a 5xx, or a stream's error event with a 5xx
code: what vLLM answers when the engine fails the request, a failed or timed-out KV transfer included) is
named to the client with that likely cause, the prefill instance, and its answer quoted (200 characters).

The prefill leaves a grant on the producer until a decode pulls it. When no decode instance answered 200
(each failed, or one refused with 4xx: a refusal comes before any pull) or the request ended otherwise
after the prefill (the client left, the router failed), ``release_grant(params, request_id)`` is awaited so
that the producer frees the blocks at once rather than at the lease's end."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from kpool_pd.router.attempts import FAILED, Attempts, quoted
from kpool_pd.router.backends import Backends
from kpool_pd.router.bodies import InstanceRefused, decode_body, kv_transfer_params_of, prefill_body, streams
from kpool_pd.router.instances import Instance, InstancePool
from kpool_pd.router.metrics import Outcome, RouterMetrics
from kpool_pd.router.prefix import PromptShape, prompt_shape
from kpool_pd.router.settings import RouterSettings

logger = logging.getLogger(__name__)

ReleaseGrant = Callable[[dict, str], Awaitable[bool]]  # (the prefill's kv_transfer_params, request id) -> released

_STREAM_BROKE = b'data: {"error": {"message": "the decode instance stopped mid-answer", "type": "upstream_error", ' \
                b'"code": 502}}\n\n'
_SCAN_TAIL = 64 * 1024  # the longest partial event held back; a longer one is passed on as it is
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_TRANSFER_CAUSE = "e.g. its KV transfer failed or timed out"


def failed_after_prefill(status: int, answer: str, prefilled_on: str) -> str:
    """Why a decode instance that answered ``status`` (5xx) failed: the likely cause, its answer quoted."""
    return f"HTTP {status}: it failed the request after its prefill on {prefilled_on}, {_TRANSFER_CAUSE}; " \
           f"it answered {answer}"


def _error_of(event: bytes) -> dict | None:
    """The error object of a server-sent event that carries one (OpenAI's ``{"error": {...}}`` or vLLM's
    older ``{"object": "error", ...}``), else None."""
    data = event.strip().removeprefix(b"data:").strip()
    if b"error" not in data:
        return None
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    if isinstance(parsed.get("error"), dict):
        return parsed
    return parsed if parsed.get("object") == "error" else None


class _EventRelay:
    """A decode instance's server-sent event stream on its way to the client, an event at a time: whether an
    event carried an error, whether ``[DONE]`` came (vLLM ends every stream with it, after an error event
    too). An error event with a 5xx code (vLLM's answer when a request fails in the engine, a failed KV
    load included) is passed on with a message that names both instances and the likely cause, and quotes
    the instance's own message; every other event is passed on as it came."""

    def __init__(self, decode_url: str, prefilled_on: str) -> None:
        self.error: str | None = None
        self.done = False
        self._decode_url, self._prefilled_on = decode_url, prefilled_on
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete events of what arrived so far, to send on now; a partial event is held back (up to
        64 KiB, then passed on as it is)."""
        buffer, out, start = self._tail + chunk, [], 0
        for end in _EVENT_END.finditer(buffer):
            out.append(self._event(buffer[start:end.start()]) + end.group())
            start = end.end()
        self._tail = buffer[start:]
        if len(self._tail) > _SCAN_TAIL:
            out.append(self._tail)
            self._tail = b""
        return b"".join(out)

    def flush(self) -> bytes:
        """What is held back at the stream's end."""
        tail, self._tail = self._tail, b""
        return self._event(tail) if tail.strip() else tail

    def _event(self, event: bytes) -> bytes:
        if event.strip().removeprefix(b"data:").strip() == b"[DONE]":
            self.done = True
            return event
        parsed = _error_of(event)
        if parsed is None:
            return event
        if self.error is None:
            self.error = event.strip().removeprefix(b"data:").strip()[:200].decode(errors="replace")
        error = parsed["error"] if isinstance(parsed.get("error"), dict) else parsed
        code = error.get("code")
        if not (isinstance(code, int) and code >= 500):
            return event
        said = error.get("message")
        said = quoted(said.encode()) if isinstance(said, str) else quoted(json.dumps(error).encode())
        error["message"] = (f"the decode instance {self._decode_url} failed the request after its prefill on "
                            f"{self._prefilled_on}, {_TRANSFER_CAUSE}; it said: {said}")
        return b"data: " + json.dumps(parsed).encode()


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

    async def route(self, request: web.Request, path: str, body: dict, headers: dict[str, str], request_id: str,
                    arrived: float) -> tuple[web.StreamResponse, Outcome]:
        """The client's answer and how it went. RouterError (502) when every instance of a role failed;
        InstanceRefused when a prefill instance refused the request (4xx). Releases the prefill's grant
        whenever no decode instance answered 200, whatever the way out (cancellation included)."""
        shape = prompt_shape(body, self.settings.prefix_block_tokens)
        planned = self.decode_pool.choose(set(), shape) if self.settings.decode_engine_ids else None
        prefetch_by = self.settings.engine_id_of(planned.url) if planned is not None else None
        params, prefilled_on = await self.prefill(path, body, headers, request_id, shape, prefetch_by)
        answered = [False]
        try:
            response, outcome = await self.decode(request, path, body, params, prefilled_on, headers, request_id,
                                                  arrived, answered, shape, planned)
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

    async def prefill(self, path: str, body: dict, headers: dict[str, str], request_id: str,
                      shape: PromptShape, prefetch_by: str | None = None) -> tuple[dict, str]:
        """The ``kv_transfer_params`` of a prefill of ``body`` (its prompt's ``shape``; ``prefetch_by``: the vLLM
        engine_id of the decode instance planned for it, named to the producer) and the URL of the instance that
        made it. RouterError (502) when every prefill instance failed; InstanceRefused when one refused the
        request (4xx)."""
        attempts = Attempts(self.prefill_pool, self.metrics, self.settings.retry_pause_s, shape)
        payload, timeout_s = prefill_body(body, prefetch_by), self.settings.prefill_timeout_s
        pool = attempts.pool
        while (instance := await attempts.next()) is not None:
            started = time.perf_counter()
            with pool.outstanding(instance, shape.prompt_tokens):
                try:
                    async with self.backends.post(instance.url + path, payload, headers, self._prefill_timeout,
                                                  request_id) as answer:
                        raw = await answer.read()
                        status, content_type = answer.status, answer.content_type
                except FAILED as error:
                    attempts.failed(instance, error, timeout_s, request_id)
                    continue
            if 400 <= status < 500:
                logger.info("request %s: prefill instance %s refused it: HTTP %d", request_id, instance.url, status)
                raise InstanceRefused(status, raw, content_type)
            if status != 200:
                attempts.failed(instance, f"HTTP {status}: {quoted(raw)}", timeout_s, request_id)
                continue
            try:
                params = kv_transfer_params_of(raw)
            except ValueError as error:
                attempts.failed(instance, str(error), timeout_s, request_id)
                continue
            pool.succeeded(instance)
            self.metrics.prefill_seconds.observe(time.perf_counter() - started)
            logger.info("request %s: prefilled on %s in %.3f s", request_id, instance.url, time.perf_counter() - started)
            return params, instance.url
        raise attempts.exhausted()

    async def decode(self, request: web.Request, path: str, body: dict, params: dict, prefilled_on: str,
                     headers: dict[str, str], request_id: str, arrived: float,
                     answered: list[bool], shape: PromptShape,
                     planned: Instance | None = None) -> tuple[web.StreamResponse, Outcome]:
        """The decode instance's answer to the client (streamed when the client asked for a stream), and
        how it went; ``answered[0]`` is set once a decode instance answered 200 (it pulls the KV from
        ``prefilled_on``, the prefill instance's URL). An instance's 4xx is returned as it is. RouterError
        (502) when every decode instance failed before answering; a 5xx is named as a failure after the
        prefill (its KV transfer, likely), with the instance's answer quoted. ``planned``: the instance chosen
        before the prefill (tried first)."""
        attempts = Attempts(self.decode_pool, self.metrics, self.settings.retry_pause_s, shape, first=planned)
        payload, timeout_s = decode_body(body, params), self.settings.decode_timeout_s
        pool = attempts.pool
        while (instance := await attempts.next()) is not None:
            with pool.outstanding(instance, shape.total_tokens):
                try:
                    async with self.backends.post(instance.url + path, payload, headers, self._decode_timeout,
                                                  request_id) as answer:
                        if answer.status >= 500:
                            why = failed_after_prefill(answer.status, quoted(await answer.read()), prefilled_on)
                            attempts.failed(instance, why, timeout_s, request_id)
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
                        return await self._relay(request, answer, attempts, instance, prefilled_on, request_id,
                                                 arrived)
                except FAILED as error:
                    attempts.failed(instance, error, timeout_s, request_id)
        raise attempts.exhausted()

    async def _relay(self, request: web.Request, answer: aiohttp.ClientResponse, attempts: Attempts,
                     instance: Instance, prefilled_on: str, request_id: str,
                     arrived: float) -> tuple[web.StreamResponse, Outcome]:
        """Streams ``answer`` (server-sent events) to the client an event at a time as they arrive (an error
        event of the instance's with a 5xx code reworded by ``_EventRelay``). When the decode instance breaks
        off, the client gets an error event in place of the partial one and the stream ends (UPSTREAM_ERROR,
        the instance marked failed); a stream that carries an error event or ends without ``[DONE]`` is
        UPSTREAM_ERROR too. When the client goes away (a failed write, or the handler cancelled), closing
        ``answer`` closes its connection, which tells the instance to stop."""
        out = web.StreamResponse(status=200, headers={"Content-Type": answer.headers.get("Content-Type",
                                                                                          "text/event-stream"),
                                                      "Cache-Control": "no-cache"})
        scan, first = _EventRelay(instance.url, prefilled_on), True
        try:
            await out.prepare(request)
            async for chunk in answer.content.iter_any():
                if first:
                    self.metrics.first_byte_seconds.observe(time.perf_counter() - arrived)
                    first = False
                if events := scan.feed(chunk):
                    await out.write(events)
            if rest := scan.flush():
                await out.write(rest)
        except ConnectionResetError:  # the client went away (aiohttp's is a ClientError too)
            logger.info("request %s: the client went away mid-stream; stopping it on %s", request_id, instance.url)
            answer.close()
            return out, Outcome.CLIENT_ERROR
        except asyncio.CancelledError:
            logger.info("request %s: the client went away mid-stream; stopping it on %s", request_id, instance.url)
            answer.close()
            raise
        except FAILED as error:
            attempts.failed(instance, error, self.settings.decode_timeout_s, request_id)
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
