"""Small fake OpenAI servers for tests/test_router.py: a prefill instance that answers a one-token
completion with ``kv_transfer_params`` as a kv_producer does, a decode instance that answers with a
completion or a stream of server-sent events; each records what it was sent and can be told to fail."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.test_utils import TestServer

STREAM_EVENTS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
                 b"data: [DONE]\n\n"]


@dataclass
class Sent:
    body: dict
    headers: dict


@dataclass
class FakeInstance:
    """``name`` goes into what it answers. ``fail_status``: answer every request with it. ``hang``: answer only
    after the client closed the connection. ``stream_gate``: a streaming decode waits on it after its first event. ``break_stream``: close the
    connection after the first event. ``no_params``: a prefill that returns no kv_transfer_params."""

    name: str
    fail_status: int = 0
    hang: bool = False
    stream_gate: asyncio.Event | None = None
    break_stream: bool = False
    no_params: bool = False
    sent: list[Sent] = field(default_factory=list)
    url: str = ""  # http://127.0.0.1:PORT once serving

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.sent.append(Sent(body, request.headers.copy()))  # case-insensitive
        if self.hang:  # until the router gives up and closes the connection
            deadline = asyncio.get_running_loop().time() + 30
            while request.transport is not None and not request.transport.is_closing():
                if asyncio.get_running_loop().time() > deadline:
                    raise AssertionError(f"{self.name}: the router kept waiting on a hung instance")
                await asyncio.sleep(0.02)
            return web.Response(status=599)
        if self.fail_status:
            return web.json_response({"error": {"message": f"{self.name} says no"}}, status=self.fail_status)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            params = None if self.no_params else {"do_remote_prefill": True, "remote_engine_id": self.name,
                                                  "remote_request_id": request.headers.get("X-Request-Id")}
            return web.json_response({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": params})
        if not body.get("stream"):
            return web.json_response({"id": "d", "served_by": self.name, "choices": [{"text": "ab"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(STREAM_EVENTS[0])
        if self.break_stream:
            request.transport.close()
            return out
        if self.stream_gate is not None:
            await self.stream_gate.wait()
        for event in STREAM_EVENTS[1:]:
            await out.write(event)
        await out.write_eof()
        return out

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        return app


@contextlib.asynccontextmanager
async def serving(*instances: FakeInstance):
    """Each instance listening on a loopback port of its own while the block runs."""
    async with contextlib.AsyncExitStack() as stack:
        for instance in instances:
            server = await stack.enter_async_context(TestServer(instance.app(), host="127.0.0.1"))
            instance.url = str(server.make_url("")).rstrip("/")
        yield instances


def last_body(instance: FakeInstance) -> dict:
    return instance.sent[-1].body


def sse_events(raw: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def as_json(raw: bytes) -> dict:
    return json.loads(raw)
