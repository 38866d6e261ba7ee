"""The router's HTTP server (aiohttp): ``/v1/completions`` and ``/v1/chat/completions`` through a prefill
and a decode instance, ``/health`` and ``/metrics``."""

from __future__ import annotations

import logging
import time
import uuid
from http import HTTPStatus

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kpool_pd.router.bodies import InstanceRefused, RouterError, parse_request
from kpool_pd.router.instances import InstancePool, Role
from kpool_pd.router.metrics import Outcome, RouterMetrics
from kpool_pd.router.pd import PdRouter
from kpool_pd.router.settings import RouterSettings

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
_FORWARDED_HEADERS = ("Authorization",)
_ROUTER = web.AppKey("router", PdRouter)
_POOLS = web.AppKey("pools", tuple)
_METRICS = web.AppKey("metrics", RouterMetrics)


def _forwarded_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    return headers | {"X-Request-Id": request_id}


async def _pd(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    router, metrics, path = request.app[_ROUTER], request.app[_METRICS], request.path
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    try:
        body = parse_request(await request.read())
        headers = _forwarded_headers(request, request_id)
        params = await router.prefill(path, body, headers, request_id)
        response, outcome = await router.decode(request, path, body, params, headers, request_id, arrived)
    except RouterError as error:
        metrics.answered(path, Outcome.CLIENT_ERROR if error.status < 500 else Outcome.UPSTREAM_ERROR)
        logger.warning("request %s: %s", request_id, error.message)
        return error.response()
    except InstanceRefused as refused:
        metrics.answered(path, Outcome.CLIENT_ERROR)
        return refused.response()
    metrics.answered(path, outcome)
    logger.info("request %s: %s in %.3f s", request_id, outcome.value, time.perf_counter() - arrived)
    return response


async def _health(request: web.Request) -> web.Response:
    """200 while each role has an instance that has not failed lately, else 503; the instances either way."""
    pools: tuple[InstancePool, ...] = request.app[_POOLS]
    ready = all(pool.usable() for pool in pools)
    instances = [{"role": pool.role.value, "url": i.url, "outstanding": i.outstanding, "failed_lately": pool.cooling(i)}
                 for pool in pools for i in pool.instances]
    return web.json_response({"status": "ok" if ready else "unavailable", "instances": instances},
                             status=HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[_METRICS].registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(settings: RouterSettings) -> web.Application:
    """The router as an aiohttp application; its client session opens on start-up and closes on clean-up."""
    pools = (InstancePool(Role.PREFILL, settings.prefill, cooldown_s=settings.cooldown_s),
             InstancePool(Role.DECODE, settings.decode, cooldown_s=settings.cooldown_s))
    app = web.Application(client_max_size=64 * 1024 * 1024)  # long prompts as token ids
    app[_POOLS], app[_METRICS] = pools, RouterMetrics(pools)

    async def session(app: web.Application):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
            app[_ROUTER] = PdRouter(settings, client, *pools, app[_METRICS])
            yield

    app.cleanup_ctx.append(session)
    app.router.add_post(COMPLETIONS, _pd)
    app.router.add_post(CHAT_COMPLETIONS, _pd)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


def run_router(settings: RouterSettings) -> int:
    """Serves until SIGINT or SIGTERM."""
    logger.info("router on %s:%d: prefill %s, decode %s", settings.host, settings.port, ", ".join(settings.prefill),
                ", ".join(settings.decode))
    web.run_app(build_app(settings), host=settings.host, port=settings.port, print=None,
                access_log=logging.getLogger("kpool_pd.router.access"))
    return 0
