"""One PD request: a prefill instance computes the prompt and keeps its KV (one token, ``do_remote_decode``),
then a decode instance pulls that KV (``do_remote_prefill``, the prefill's ``kv_transfer_params``) and
generates, its answer streamed back to the client as it comes. Each role's instance is the one with the
fewest outstanding requests; one that cannot be reached, times out or answers 5xx is skipped for the next,
and when every one failed the client's 502 names each with what went wrong."""

from __future__ import annotations

import logging
import time
from http import HTTPStatus

import aiohttp
from aiohttp import web

from kpool_pd.router.bodies import (InstanceRefused, RouterError, decode_body, kv_transfer_params_of, prefill_body,
                                    streams)
from kpool_pd.router.instances import Instance, InstancePool
from kpool_pd.router.metrics import Outcome, RouterMetrics
from kpool_pd.router.settings import RouterSettings

logger = logging.getLogger(__name__)

_FAILED = (aiohttp.ClientError, TimeoutError)
_STREAM_BROKE = b'data: {"error": {"message": "the decode instance stopped mid-answer", "type": "upstream_error", ' \
                b'"code": 502}}\n\n'


def _describe(error: BaseException, timeout_s: float) -> str:
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class PdRouter:
    """Sends each request through a prefill and a decode instance over one ``aiohttp.ClientSession``."""

    def __init__(self, settings: RouterSettings, session: aiohttp.ClientSession, prefill: InstancePool,
                 decode: InstancePool, metrics: RouterMetrics) -> None:
        self.settings, self.session, self.metrics = settings, session, metrics
        self.prefill_pool, self.decode_pool = prefill, decode
        self._prefill_timeout = aiohttp.ClientTimeout(total=settings.prefill_timeout_s,
                                                      sock_connect=settings.connect_timeout_s)
        self._decode_timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s,
                                                     sock_read=settings.decode_timeout_s)

    def _failed(self, pool: InstancePool, instance: Instance, why: str, failures: list[str], request_id: str) -> None:
        pool.failed(instance)
        self.metrics.instance_failures.labels(pool.role.value, instance.url).inc()
        failures.append(f"{instance.url} ({why})")
        logger.warning("request %s: %s instance %s failed: %s", request_id, pool.role.value, instance.url, why)

    def _exhausted(self, pool: InstancePool, failures: list[str]) -> RouterError:
        return RouterError(HTTPStatus.BAD_GATEWAY, f"every {pool.role.value} instance failed: " + "; ".join(failures))

    async def prefill(self, path: str, body: dict, headers: dict[str, str], request_id: str) -> dict:
        """The ``kv_transfer_params`` of a prefill of ``body``. RouterError (502) when every prefill
        instance failed; InstanceRefused when one refused the request (4xx)."""
        pool, failures, tried = self.prefill_pool, [], set()
        payload = prefill_body(body)
        while (instance := pool.choose(tried)) is not None:
            tried.add(instance.url)
            started = time.perf_counter()
            with pool.outstanding(instance):
                try:
                    async with self.session.post(instance.url + path, json=payload, headers=headers,
                                                 timeout=self._prefill_timeout) as answer:
                        raw = await answer.read()
                        status, content_type = answer.status, answer.content_type
                except _FAILED as error:
                    self._failed(pool, instance, _describe(error, self.settings.prefill_timeout_s), failures,
                                 request_id)
                    continue
            if 400 <= status < 500:
                logger.info("request %s: prefill instance %s refused it: HTTP %d", request_id, instance.url, status)
                raise InstanceRefused(status, raw, content_type)
            if status != 200:
                self._failed(pool, instance, f"HTTP {status}: {raw[:200].decode(errors='replace')}", failures,
                             request_id)
                continue
            try:
                params = kv_transfer_params_of(raw)
            except ValueError as error:
                self._failed(pool, instance, str(error), failures, request_id)
                continue
            pool.succeeded(instance)
            self.metrics.prefill_seconds.observe(time.perf_counter() - started)
            logger.info("request %s: prefilled on %s in %.3f s", request_id, instance.url, time.perf_counter() - started)
            return params
        raise self._exhausted(pool, failures)

    async def decode(self, request: web.Request, path: str, body: dict, params: dict, headers: dict[str, str],
                     request_id: str, arrived: float) -> tuple[web.StreamResponse, Outcome]:
        """The decode instance's answer to the client (streamed when the client asked for a stream), and
        how it went. RouterError (502) when every decode instance failed before answering."""
        pool, failures, tried = self.decode_pool, [], set()
        payload = decode_body(body, params)
        while (instance := pool.choose(tried)) is not None:
            tried.add(instance.url)
            with pool.outstanding(instance):
                try:
                    async with self.session.post(instance.url + path, json=payload, headers=headers,
                                                 timeout=self._decode_timeout) as answer:
                        if answer.status >= 500:
                            raw = await answer.read()
                            self._failed(pool, instance, f"HTTP {answer.status}: {raw[:200].decode(errors='replace')}",
                                         failures, request_id)
                            continue
                        if not (streams(body) and answer.status == 200):
                            raw = await answer.read()
                            self.metrics.first_byte_seconds.observe(time.perf_counter() - arrived)
                            pool.succeeded(instance)
                            outcome = Outcome.OK if answer.status == 200 else Outcome.CLIENT_ERROR
                            return web.Response(status=answer.status, body=raw,
                                                content_type=answer.content_type), outcome
                        return await self._relay(request, answer, pool, instance, request_id, arrived)
                except _FAILED as error:
                    self._failed(pool, instance, _describe(error, self.settings.decode_timeout_s), failures, request_id)
        raise self._exhausted(pool, failures)

    async def _relay(self, request: web.Request, answer: aiohttp.ClientResponse, pool: InstancePool,
                     instance: Instance, request_id: str, arrived: float) -> tuple[web.StreamResponse, Outcome]:
        """Streams ``answer`` (server-sent events) to the client as its bytes arrive. When the decode
        instance breaks off, the client gets an error event and the stream ends; when the client goes
        away, closing ``answer`` tells the instance to stop."""
        out = web.StreamResponse(status=200, headers={"Content-Type": answer.headers.get("Content-Type",
                                                                                          "text/event-stream"),
                                                      "Cache-Control": "no-cache"})
        await out.prepare(request)
        first = True
        try:
            async for chunk in answer.content.iter_any():
                if first:
                    self.metrics.first_byte_seconds.observe(time.perf_counter() - arrived)
                    first = False
                try:
                    await out.write(chunk)
                except ConnectionResetError:  # the client went away (aiohttp's is a ClientError too)
                    logger.info("request %s: the client went away mid-stream; stopping it on %s", request_id,
                                instance.url)
                    answer.close()
                    return out, Outcome.CLIENT_ERROR
        except _FAILED as error:
            self._failed(pool, instance, _describe(error, self.settings.decode_timeout_s), [], request_id)
            await out.write(_STREAM_BROKE)
            await out.write_eof()
            return out, Outcome.UPSTREAM_ERROR
        pool.succeeded(instance)
        await out.write_eof()
        return out, Outcome.OK
