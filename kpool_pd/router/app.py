"""The router's HTTP server (aiohttp). It serves:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` through a prefill and a decode instance (``pd``);
- ``GET /v1/models``, ``GET /version``, ``POST /tokenize`` and ``POST /detokenize`` passed through to one
  decode instance, its answer as it is (``passthrough``);
- ``GET /health`` (each instance's state) and ``GET /metrics`` (Prometheus), both open when the router has
  an API key (which /v1/* needs).

Instances given as ``dns:///NAME:PORT`` are resolved once at start-up and every ``discovery_s`` after
(``discovery``).

Any other path gets a 404, a served path asked with another method a 405, each in OpenAI's error shape
naming the path and listing what the router serves.

``build_app`` makes the application; ``serving`` serves it on its address with the client guard of
``intake`` (header deadline, connection cap) and cancels a request's handler when its client goes away
(which closes its decode stream); ``run_router`` serves until SIGINT or SIGTERM. A request is answered
with OpenAI's error shape when the router refuses it: 400 for a body it cannot route, 401 without the
router's key, 404 and 405 for what it does not serve, 408 when its body is slower than ``body_timeout_s``,
413 over ``max_body_mb``, 502 when every instance of a role failed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kpool_pd.router.backends import Backends
from kpool_pd.router.bodies import Endpoint, InstanceRefused, RouterError, error_response, parse_request
from kpool_pd.router.discovery import Discovery, Resolver, resolve_addresses
from kpool_pd.router.headers import authorized, backend_headers, request_id_of
from kpool_pd.router.instances import InstancePool, Role
from kpool_pd.router.intake import ClientGuard
from kpool_pd.router.metrics import Outcome, RouterMetrics
from kpool_pd.router.passthrough import Passed, Passthrough
from kpool_pd.router.prefix import PrefixTable
from kpool_pd.router.pd import PdRouter, ReleaseGrant
from kpool_pd.router.probes import HealthProber
from kpool_pd.router.settings import RouterSettings

logger = logging.getLogger(__name__)

COMPLETIONS = Endpoint.COMPLETIONS.value
CHAT_COMPLETIONS = Endpoint.CHAT_COMPLETIONS.value
_SETTINGS = web.AppKey("settings", RouterSettings)
_ROUTER = web.AppKey("router", PdRouter)
_PASSTHROUGH = web.AppKey("passthrough", Passthrough)
_POOLS = web.AppKey("pools", tuple)
_METRICS = web.AppKey("metrics", RouterMetrics)
_GUARD = web.AppKey("guard", ClientGuard)
_ACCESS_LOG = logging.getLogger("kpool_pd.router.access")
_PASSED = {passed.path: passed for passed in Passed}
_SHOWN_PATH = 200  # characters of an unserved path quoted back


async def _body(request: web.Request, settings: RouterSettings) -> bytes:
    """The request's body within ``body_timeout_s`` and ``max_body_mb``; RouterError (408, 413) otherwise."""
    too_large = RouterError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                            f"the request body is over the router's limit of {settings.max_body_mb:g} MiB")
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        raise too_large
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise RouterError(HTTPStatus.REQUEST_TIMEOUT,
                          f"the request body did not arrive within {settings.body_timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


Route = Callable[[str], Awaitable[tuple[web.StreamResponse, Outcome]]]  # request id -> (answer, outcome)


async def _served(request: web.Request, arrived: float, route: Route) -> web.StreamResponse:
    """``route``'s answer to ``request``, counted by outcome under its path; a RouterError, an instance's
    refusal (InstanceRefused) or a fault of the router's own answered in OpenAI's error shape."""
    path, metrics = request.path, request.app[_METRICS]
    request_id = request_id_of(request.headers)
    try:
        response, outcome = await route(request_id)
    except RouterError as error:
        metrics.answered(path, Outcome.CLIENT_ERROR if error.status < 500 else Outcome.UPSTREAM_ERROR)
        logger.warning("request %s: %s", request_id, error.message)
        response = error.response()
        if error.status in (HTTPStatus.REQUEST_TIMEOUT, HTTPStatus.REQUEST_ENTITY_TOO_LARGE):
            response.force_close()  # the rest of its body is not read
        return response
    except InstanceRefused as refused:
        metrics.answered(path, Outcome.CLIENT_ERROR)
        return refused.response()
    except Exception as error:  # a fault of the router's own: logged, answered in OpenAI's shape
        logger.exception("request %s: the router failed", request_id)
        metrics.answered(path, Outcome.UPSTREAM_ERROR)
        return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"the router failed: {type(error).__name__}")
    metrics.answered(path, outcome)
    logger.info("request %s: %s in %.3f s", request_id, outcome.value, time.perf_counter() - arrived)
    return response


def _backend_headers(request: web.Request, request_id: str) -> dict[str, str]:
    settings = request.app[_SETTINGS]
    return backend_headers(request.headers, request_id, api_key=settings.api_key,
                           backend_api_key=settings.backend_api_key)


async def _pd(request: web.Request) -> web.StreamResponse:
    arrived, settings = time.perf_counter(), request.app[_SETTINGS]

    async def route(request_id: str) -> tuple[web.StreamResponse, Outcome]:
        body = parse_request(await _body(request, settings), Endpoint(request.path))
        return await request.app[_ROUTER].route(request, request.path, body, _backend_headers(request, request_id),
                                                request_id, arrived)
    return await _served(request, arrived, route)


async def _passthrough(request: web.Request) -> web.StreamResponse:
    arrived, settings, passed = time.perf_counter(), request.app[_SETTINGS], _PASSED[request.path]

    async def route(request_id: str) -> tuple[web.StreamResponse, Outcome]:
        body = await _body(request, settings) if passed.method == "POST" else None
        return await request.app[_PASSTHROUGH].forward(passed, body, _backend_headers(request, request_id),
                                                       request_id)
    return await _served(request, arrived, route)


def _serves(app: web.Application) -> str:
    """What the router serves, in the order its routes were added: ``POST /v1/completions, ...``."""
    served = {f"{route.method} {route.resource.canonical}": None for route in app.router.routes()
              if route.method != "HEAD" and route.resource is not None}
    return ", ".join(served)


@web.middleware
async def _not_served(request: web.Request, handler) -> web.StreamResponse:
    """A path the router does not serve (404) or a method a served path does not take (405), answered in
    OpenAI's error shape with what the router serves, in place of aiohttp's plain-text page."""
    refused = getattr(request.match_info, "http_exception", None)
    if refused is None:
        return await handler(request)
    shown = request.path if len(request.path) <= _SHOWN_PATH else request.path[:_SHOWN_PATH] + "..."
    if refused.status == HTTPStatus.METHOD_NOT_ALLOWED:
        takes = " or ".join(sorted(m for m in refused.allowed_methods if m != "HEAD"))
        response = error_response(HTTPStatus.METHOD_NOT_ALLOWED,
                                  f"{shown} takes {takes}, not {request.method}; the router serves "
                                  f"{_serves(request.app)}")
        response.headers["Allow"] = ", ".join(sorted(refused.allowed_methods))
        return response
    if refused.status == HTTPStatus.NOT_FOUND:
        return error_response(HTTPStatus.NOT_FOUND, f"the router does not serve {request.method} {shown}; it "
                                                    f"serves {_serves(request.app)}")
    return await handler(request)


@web.middleware
async def _authenticate(request: web.Request, handler) -> web.StreamResponse:
    """With an API key, /v1/* needs ``Authorization: Bearer <key>``; 401 otherwise."""
    api_key = request.app[_SETTINGS].api_key
    if api_key is not None and request.path.startswith("/v1/") and not authorized(request.headers, api_key):
        logger.warning("refused a request to %s from %s: no valid API key", request.path, request.remote)
        response = error_response(HTTPStatus.UNAUTHORIZED, "a valid API key is required: Authorization: Bearer <key>")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response
    return await handler(request)


async def _health(request: web.Request) -> web.Response:
    """200 while each role has an instance that is up, else 503 saying which role has none; each instance
    with its state and its last failure (reason, seconds ago) either way."""
    pools: tuple[InstancePool, ...] = request.app[_POOLS]
    unusable = [pool.role.value for pool in pools if not pool.usable()]
    report = {"status": "unavailable" if unusable else "ok",
              "instances": [entry for pool in pools for entry in pool.report()]}
    if unusable:
        report["reason"] = "no instance is up for " + " and ".join(unusable)
    return web.json_response(report, status=HTTPStatus.SERVICE_UNAVAILABLE if unusable else HTTPStatus.OK)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[_METRICS].registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(settings: RouterSettings, *, release_grant: ReleaseGrant | None = None,
              resolver: Resolver = resolve_addresses) -> web.Application:
    """The router as an aiohttp application. On start-up it resolves its DNS targets (with ``resolver``),
    opens its clients to the instances, its grant releaser (``grants.GrantReleaser`` unless ``release_grant``
    is given), its health probes and its re-resolves; clean-up stops them in reverse."""
    pools = tuple(InstancePool(role, settings.listed(role.value), cooldown_s=settings.cooldown_s,
                               prefix=PrefixTable(settings.prefix_table_size),
                               affinity_margin_tokens=settings.affinity_margin_tokens)
                  for role in (Role.PREFILL, Role.DECODE))
    metrics = RouterMetrics(pools)
    guard = ClientGuard(header_timeout_s=settings.header_timeout_s, max_connections=settings.max_connections,
                        dropped=metrics.dropped)
    metrics.client_connections.set_function(lambda: len(guard))
    app = web.Application(client_max_size=settings.max_body_bytes,
                          middlewares=[guard.middleware, _authenticate, _not_served])
    app[_SETTINGS], app[_POOLS], app[_METRICS], app[_GUARD] = settings, pools, metrics, guard

    async def started(app: web.Application):
        async with contextlib.AsyncExitStack() as stack:
            if settings.discovered("prefill") or settings.discovered("decode"):
                discovery = Discovery({pool: (settings.listed(pool.role.value), settings.discovered(pool.role.value))
                                       for pool in pools}, period_s=settings.discovery_s,
                                      timeout_s=settings.connect_timeout_s, resolver=resolver)
                await discovery.refresh()
                resolving = asyncio.get_running_loop().create_task(discovery.run())
                stack.push_async_callback(_cancelled, resolving)
            backends = await stack.enter_async_context(Backends(keepalive_s=settings.backend_keepalive_s))
            release = release_grant
            if release is None:
                from kpool_pd.router.grants import GrantReleaser  # another module's; loaded only when serving

                releaser = GrantReleaser(peer_token=settings.peer_token, timeout_s=settings.connect_timeout_s)
                stack.push_async_callback(releaser.close)
                release = releaser.release
            app[_ROUTER] = router = PdRouter(settings, backends, *pools, metrics, release)
            app[_PASSTHROUGH] = Passthrough(settings, backends, pools[1], metrics)
            stack.push_async_callback(router.close)
            if settings.health_check_s > 0:
                prober = HealthProber(pools, backends.fresh, period_s=settings.health_check_s,
                                      timeout_s=settings.health_timeout_s)
                probing = asyncio.get_running_loop().create_task(prober.run())
                stack.push_async_callback(_cancelled, probing)
            yield

    app.cleanup_ctx.append(started)
    app.router.add_post(COMPLETIONS, _pd)
    app.router.add_post(CHAT_COMPLETIONS, _pd)
    for passed in Passed:
        app.router.add_route(passed.method, passed.path, _passthrough)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@contextlib.asynccontextmanager
async def serving(settings: RouterSettings, app: web.Application) -> AsyncIterator[str]:
    """Serves ``app`` (from ``build_app(settings)``) on ``settings.host``/``port`` (0: a free port) while
    the block runs; yields its base URL. Each connection is watched by the app's client guard."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=_ACCESS_LOG)
    await runner.setup()
    try:
        server = await asyncio.get_running_loop().create_server(
            app[_GUARD].protocol_factory(runner.server), settings.host, settings.port,
            backlog=settings.max_connections, reuse_address=True)
        try:
            host, port = server.sockets[0].getsockname()[:2]
            yield f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        finally:
            server.close()
    finally:
        await runner.cleanup()


def _raise_open_files_limit(max_connections: int) -> None:
    """Room for each client connection and its two instance connections: the soft limit on open files is
    raised toward the hard one when it is short; a warning when even the hard one is."""
    needed = 3 * max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < needed:
            logger.warning("open files limited to %d (hard limit), under the %d that --max-connections %d may use",
                           raised, needed, max_connections)


def run_router(settings: RouterSettings) -> int:
    """Serves until SIGINT or SIGTERM."""
    _raise_open_files_limit(settings.max_connections)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with serving(settings, build_app(settings)) as url:
            logger.info("router on %s: prefill %s, decode %s", url, ", ".join(settings.prefill),
                        ", ".join(settings.decode))
            await stop.wait()  # a signal, not a peer
        logger.info("router stopped")

    asyncio.run(serve())
    return 0
