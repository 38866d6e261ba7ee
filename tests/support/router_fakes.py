"""Small fake OpenAI servers for the router's tests (tests/router/): a prefill instance that
answers a one-token completion with ``kv_transfer_params`` as a kv_producer does, a decode instance that
answers with a completion or a stream of server-sent events, and either answering ``/v1/models``,
``/version``, ``/tokenize`` and ``/detokenize`` as ``vllm serve`` does; each records what it was sent and
can be told to fail. Also a backend that never answers, a proxy that closes idle keep-alive connections as
vLLM's server does, and the router itself on a loopback port (``routed``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from kpool_pd.router.app import build_app, serving as router_serving
from kpool_pd.router.settings import RouterSettings

STREAM_EVENTS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
                 b"data: [DONE]\n\n"]
ERROR_EVENT = b'data: {"error": {"message": "pull failed", "type": "InternalServerError", "code": 500}}\n\n'
MODEL = "tiny-llama"
VERSION_TYPE = "application/json; charset=utf-8"  # what the fake's /version says its body is
WAIT_S = 30.0  # the longest a fake waits on the router


@dataclass
class Sent:
    body: dict | None  # None: a GET
    headers: dict
    path: str = "/v1/completions"


@dataclass
class FakeInstance:
    """``name`` goes into what it answers. ``fail_status``: answer requests with it (the first ``fail_times``
    of them, every one when None). ``hang``: answer only after the client closed the connection (``/health``
    too). ``stream_gate``: a streaming decode waits on it after its first event. ``break_stream``: close the
    connection after the first event. ``stream_error``: an error event after the first event, then
    ``[DONE]`` (as vLLM ends a stream that failed). ``hold_stream``: after the first event, wait for the
    client to close the connection and set ``closed_mid_stream``. ``no_params``: a prefill that returns no
    kv_transfer_params. ``health_status``: what ``GET /health`` answers (a 5xx ``fail_status`` while failing).
    ``error_code``: the code of the error event ``stream_error`` and ``fail_stream`` send. ``fail_stream``: a
    stream whose first event is that error event, then ``[DONE]`` (vLLM's stream of a request the engine
    failed before its first token, a failed KV load among the causes). ``stream_chunks``: a stream of these
    bytes, each written on its own. ``no_tokenizer``: ``/tokenize`` and ``/detokenize`` refused with 400 as
    vLLM refuses them without a tokenizer. ``fail_status`` and ``hang`` apply to ``/v1/models``, ``/version``,
    ``/tokenize`` and ``/detokenize`` as to completions."""

    name: str
    fail_status: int = 0
    fail_times: int | None = None
    hang: bool = False
    stream_gate: asyncio.Event | None = None
    break_stream: bool = False
    stream_error: bool = False
    hold_stream: bool = False
    no_params: bool = False
    health_status: int = 200
    error_code: int = 500
    fail_stream: bool = False
    stream_chunks: list[bytes] | None = None
    no_tokenizer: bool = False
    sent: list[Sent] = field(default_factory=list)
    closed_mid_stream: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""  # http://127.0.0.1:PORT once serving

    def _failing(self) -> bool:
        return bool(self.fail_status) and (self.fail_times is None or len(self.sent) <= self.fail_times)

    async def _until_closed(self, request: web.Request) -> None:
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while request.transport is not None and not request.transport.is_closing():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{self.name}: the router kept the connection open for {WAIT_S} s")
            await asyncio.sleep(0.02)

    async def _health(self, request: web.Request) -> web.Response:
        if self.hang:
            await self._until_closed(request)
            return web.Response(status=599)
        failing = self.fail_status >= 500 and (self.fail_times is None or len(self.sent) < self.fail_times)
        return web.Response(status=self.fail_status if failing else self.health_status)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.sent.append(Sent(body, request.headers.copy()))  # case-insensitive
        if self.hang:  # until the router gives up and closes the connection
            await self._until_closed(request)
            return web.Response(status=599)
        if self._failing():
            return web.json_response({"error": {"message": f"{self.name} says no"}}, status=self.fail_status)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            params = None if self.no_params else {"do_remote_prefill": True, "remote_engine_id": self.name,
                                                  "remote_request_id": request.headers.get("X-Request-Id")}
            return web.json_response({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": params})
        if not body.get("stream"):
            return web.json_response({"id": "d", "served_by": self.name, "choices": [{"text": "ab"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if self.stream_chunks is not None or self.fail_stream:
            for chunk in self.stream_chunks or [self._error_event(), STREAM_EVENTS[2]]:
                await out.write(chunk)
            await out.write_eof()
            return out
        await out.write(STREAM_EVENTS[0])
        if self.break_stream:
            request.transport.close()
            return out
        if self.hold_stream:
            try:
                await self._until_closed(request)
            except asyncio.CancelledError:  # aiohttp cancels a handler whose client went away
                self.closed_mid_stream.set()
                raise
            self.closed_mid_stream.set()
            return out
        if self.stream_error:
            await out.write(self._error_event())
        if self.stream_gate is not None:
            await self.stream_gate.wait()
        for event in STREAM_EVENTS[2 if self.stream_error else 1:]:
            await out.write(event)
        await out.write_eof()
        return out

    def _error_event(self) -> bytes:
        return ERROR_EVENT.replace(b'"code": 500', b'"code": %d' % self.error_code)

    async def _passed(self, request: web.Request) -> web.StreamResponse:
        """``/v1/models``, ``/version``, ``/tokenize`` and ``/detokenize`` as vLLM answers them (the tokenizer
        here: one token per character, its id the character's code)."""
        body = await request.json() if request.method == "POST" else None
        self.sent.append(Sent(body, request.headers.copy(), request.path))
        if self.hang:
            await self._until_closed(request)
            return web.Response(status=599)
        if self._failing():
            return web.json_response({"error": {"message": f"{self.name} says no"}}, status=self.fail_status)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "vllm", "root": MODEL,
                 "parent": None, "max_model_len": 2048, "permission": []}]})
        if request.path == "/version":
            return web.Response(body=json.dumps({"version": f"0.0.0+{self.name}"}).encode(),
                                headers={"Content-Type": VERSION_TYPE})
        if self.no_tokenizer:
            return web.json_response({"object": "error", "message": "Unable to get tokenizer because "
                                      "skip_tokenizer_init is True", "type": "BadRequestError", "param": None,
                                      "code": 400}, status=400)
        if request.path == "/tokenize":
            tokens = [ord(c) for c in body["prompt"]]
            return web.json_response({"count": len(tokens), "max_model_len": 2048, "tokens": tokens,
                                      "token_strs": None})
        return web.json_response({"prompt": "".join(chr(t) for t in body["tokens"])})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._passed)
        app.router.add_get("/version", self._passed)
        app.router.add_post("/tokenize", self._passed)
        app.router.add_post("/detokenize", self._passed)
        return app


@contextlib.asynccontextmanager
async def serving(*instances: FakeInstance):
    """Each instance listening on a loopback port of its own while the block runs."""
    async with contextlib.AsyncExitStack() as stack:
        for instance in instances:
            server = await stack.enter_async_context(TestServer(instance.app(), host="127.0.0.1"))
            instance.url = str(server.make_url("")).rstrip("/")
        yield instances


class IdleClosingProxy:
    """A TCP proxy in front of ``target`` (a base URL) that closes its keep-alive connections after ``idle_s``
    without a byte either way, as vLLM's server does after 5 s, the way a client meets that close in the
    race: the client sends its next request on a connection the server has just closed, before the close
    reached it. Here the close is made when that next request's first bytes arrive (a reset, nothing of the
    request read), so each request sent ``idle_s`` or more after the last answer on a kept connection meets
    it; ``resets`` counts them. As vLLM's server, it times only a connection between requests (its last
    bytes an answer's): a new connection's first request and a pause inside a request, as a loaded machine
    makes, are never reset. ``url`` while serving (``async with``)."""

    def __init__(self, target: str, idle_s: float) -> None:
        self.target, self.idle_s = target, idle_s
        self.resets = 0
        self.url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> IdleClosingProxy:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        host, port = self.target.removeprefix("http://").rsplit(":", 1)
        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), WAIT_S)
        loop = asyncio.get_running_loop()
        last = [loop.time()]  # the last byte either way
        answered = [False]  # the last bytes were the instance's (an answer): the connection is between requests

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, from_client: bool) -> None:
            while data := await source.read(1 << 16):
                if from_client and answered[0] and loop.time() - last[0] >= self.idle_s:
                    self.resets += 1
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                              struct.pack("ii", 1, 0))
                    writer.transport.abort()  # a reset: the client's request is not read
                    return
                sink.write(data)
                await sink.drain()
                last[0], answered[0] = loop.time(), not from_client

        try:
            done, pending = await asyncio.wait([loop.create_task(pump(reader, up_writer, True)),
                                                loop.create_task(pump(up_reader, writer, False))],
                                               return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
        except (ConnectionError, OSError):
            pass
        finally:
            up_writer.close()
            writer.close()
            self._tasks.discard(asyncio.current_task())


@contextlib.asynccontextmanager
async def silent_backend():
    """A backend that accepts connections and reads what it is sent but never answers; yields its URL."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        with contextlib.suppress(ConnectionError):
            while await reader.read(1 << 16):
                pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in held:
            writer.close()


class ReleaseRecorder:
    """A fake grant releaser: records each call's (params, request id); answers ``answer``."""

    def __init__(self, answer: bool = True) -> None:
        self.calls: list[tuple[dict, str]] = []
        self._answer = answer

    async def __call__(self, params: dict, request_id: str) -> bool:
        self.calls.append((params, request_id))
        return self._answer


@contextlib.asynccontextmanager
async def routed(prefill: list[str], decode: list[str], *, release_grant=None, **settings):
    """The router (as ``run_router`` serves it) on a loopback port in front of ``prefill`` and ``decode``;
    yields (client session, base URL). Health probes are off unless ``health_check_s`` is given; grant
    releases go to ``release_grant`` (a ReleaseRecorder by default)."""
    settings = RouterSettings(prefill=tuple(prefill), decode=tuple(decode), port=0,
                              **({"health_check_s": 0} | settings))
    app = build_app(settings, release_grant=release_grant or ReleaseRecorder())
    async with router_serving(settings, app) as base, aiohttp.ClientSession() as client:
        yield client, base


async def post(client: aiohttp.ClientSession, url: str, body, **headers) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with client.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as answer:
        return answer.status, await answer.read()


async def metric_lines(client: aiohttp.ClientSession, base: str) -> list[str]:
    async with client.get(base + "/metrics") as answer:
        return (await answer.text()).splitlines()


def last_body(instance: FakeInstance) -> dict:
    return instance.sent[-1].body


def sse_events(raw: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def as_json(raw: bytes) -> dict:
    return json.loads(raw)
