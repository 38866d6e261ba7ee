"""The requests a decode instance answers alone, passed through as it answers them: ``GET /v1/models``
(what a client such as ``openai``'s ``models.list()`` asks first), ``GET /version``, ``POST /tokenize`` and
``POST /detokenize``. Every instance of a PD pair serves the same model, so one decode instance's answer
is the router's.

The instance is chosen as a PD request's decode instance is (fewest outstanding requests, one that failed
lately or is down last) and gets the same headers (``headers.backend_headers``) and, for a POST, the
client's body as it came (within the router's limits on bodies). Its answer, whatever its status, reaches
the client as it is: body, status and content type. One that cannot be reached, does not answer within
``decode_timeout_s`` or answers 5xx is marked failed and the next is tried (``attempts``); when none
answered, the client's 502 names each with what went wrong."""

from __future__ import annotations

import enum
import logging

import aiohttp
from aiohttp import web

from kpool_pd.router.attempts import FAILED, Attempts, quoted
from kpool_pd.router.backends import Backends
from kpool_pd.router.instances import InstancePool
from kpool_pd.router.metrics import Outcome, RouterMetrics
from kpool_pd.router.settings import RouterSettings

logger = logging.getLogger(__name__)


class Passed(enum.Enum):
    """The endpoints passed through to a decode instance, as (method, path)."""

    MODELS = ("GET", "/v1/models")
    VERSION = ("GET", "/version")
    TOKENIZE = ("POST", "/tokenize")
    DETOKENIZE = ("POST", "/detokenize")

    @property
    def method(self) -> str:
        return self.value[0]

    @property
    def path(self) -> str:
        return self.value[1]


class Passthrough:
    """Sends a request to one decode instance of ``decode`` over ``backends`` and answers with its answer;
    one event loop."""

    def __init__(self, settings: RouterSettings, backends: Backends, decode: InstancePool,
                 metrics: RouterMetrics) -> None:
        self.settings, self.backends, self.decode_pool, self.metrics = settings, backends, decode, metrics
        self._timeout = aiohttp.ClientTimeout(total=settings.decode_timeout_s, sock_connect=settings.connect_timeout_s)

    async def forward(self, passed: Passed, body: bytes | None, headers: dict[str, str],
                      request_id: str) -> tuple[web.Response, Outcome]:
        """The first decode instance's answer that is not a failure, as it is, and how it went (OK for 2xx,
        CLIENT_ERROR for any other status under 500). RouterError (502) naming each instance when every
        one failed. ``body``: the POST's JSON body as the client sent it (None for a GET)."""
        attempts = Attempts(self.decode_pool, self.metrics, self.settings.retry_pause_s)
        pool, timeout_s = attempts.pool, self.settings.decode_timeout_s
        while (instance := await attempts.next()) is not None:
            with pool.outstanding(instance):
                try:
                    async with self.backends.send(passed.method, instance.url + passed.path, body, headers,
                                                  self._timeout, request_id) as answer:
                        raw, status = await answer.read(), answer.status
                        content_type = answer.headers.get("Content-Type")
                except FAILED as error:
                    attempts.failed(instance, error, timeout_s, request_id)
                    continue
            if status >= 500:
                attempts.failed(instance, f"HTTP {status}: {quoted(raw)}", timeout_s, request_id)
                continue
            pool.succeeded(instance)
            logger.info("request %s: %s %s answered by %s: HTTP %d", request_id, passed.method, passed.path,
                        instance.url, status)
            response = web.Response(status=status, body=raw,
                                    headers=None if content_type is None else {"Content-Type": content_type})
            return response, Outcome.OK if status < 400 else Outcome.CLIENT_ERROR
        raise attempts.exhausted(f"no decode instance answered {passed.method} {passed.path}")
