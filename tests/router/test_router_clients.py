"""`kpool-pd router` toward its clients, against fakes (tests/support/router_fakes.py; no vLLM): slow and idle
connections (header deadline, connection cap), body deadline and size, bodies the router refuses before
any instance sees them, request ids and the API key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
from http import HTTPStatus

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from kpool_pd.router.settings import RouterSettings, settings_from_args  # noqa: E402
from kpool_pd.router.main import build_parser  # noqa: E402
from tests.support.polling import until  # noqa: E402
from tests.support.router_fakes import FakeInstance, as_json, metric_lines, post, routed, serving  # noqa: E402

DEADLINE_S = 120.0
PROMPT = {"model": "m", "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 4, "temperature": 0}
SLOW_CLIENTS = 1100
PARTIAL_REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nX-Slow: "


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def metric(lines: list[str], prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


@pytest.fixture
def open_files_for_slow_clients():
    """Room for the slow clients' sockets and the router's ends of them, in this one process."""
    needed = 2 * SLOW_CLIENTS + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the hard limit on open files ({hard}) is under the {needed} this test needs")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def timed_request(client, base: str) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, raw = await post(client, base + "/v1/completions", PROMPT)
    assert status == 200, raw
    return loop.time() - started


def test_a_good_request_is_served_while_a_thousand_slow_clients_hold_connections(open_files_for_slow_clients):
    """1,100 connections each hold a partial request line and dribble a header byte; the router holds at
    most 1,000 (the oldest without a complete request closed first), serves a good request in about its
    usual time, and closes the slow ones at their header deadline."""
    header_timeout_s = 8.0

    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], header_timeout_s=header_timeout_s,
                                                    max_connections=1000) as (client, base):
            alone = min([await timed_request(client, base) for _ in range(3)])
            host, port = base.removeprefix("http://").rsplit(":", 1)
            slow: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
            try:
                for _ in range(SLOW_CLIENTS):
                    reader, writer = await asyncio.open_connection(host, int(port))
                    writer.write(PARTIAL_REQUEST)
                    slow.append((reader, writer))

                async def dribble():
                    while True:
                        await asyncio.sleep(1.0)  # a header byte each second: well inside any deadline
                        for _, writer in slow:
                            if not writer.is_closing():
                                writer.write(b"x")
                dribbling = asyncio.get_running_loop().create_task(dribble())

                async def held_full():
                    return metric(await metric_lines(client, base), "kpoolpd_router_client_connections ") >= 1000
                await until(held_full, "the router holding 1,000 connections", timeout_s=header_timeout_s / 2)
                loaded = await timed_request(client, base)
                lines = await metric_lines(client, base)
                held_meanwhile = metric(lines, "kpoolpd_router_client_connections ")
                over_limit = metric(lines, 'kpoolpd_router_client_connections_dropped_total{reason="over_limit"}')

                async def all_closed():
                    for reader, _ in slow:
                        if not (reader.at_eof() or await _closed(reader)):
                            return False
                    return True
                await until(all_closed, "every slow connection closed", timeout_s=header_timeout_s + 60)
                lines = await metric_lines(client, base)
                dribbling.cancel()
            finally:
                for _, writer in slow:
                    writer.close()
        assert loaded < 10 * alone + 2.0, (loaded, alone)
        assert held_meanwhile >= 999  # a thousand slow ones were open while it was served
        assert over_limit >= SLOW_CLIENTS - 1000  # the slowest went first to make room
        deadline = metric(lines, 'kpoolpd_router_client_connections_dropped_total{reason="header_deadline"}')
        assert deadline >= 990 and deadline + over_limit >= SLOW_CLIENTS
    run(scenario())


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Reads what is there without waiting; true at EOF (the 408 the router writes is read past) and when
    the router's close reset the connection (a socket closed with unread bytes, the dribbled ones, sends a
    reset, which reaches the reader as an error, never as EOF)."""
    try:
        while await asyncio.wait_for(reader.read(1024), 0.001):
            pass
    except ConnectionError:
        return True
    except asyncio.TimeoutError:
        pass
    return reader.at_eof() or reader.exception() is not None


def test_a_connection_that_never_completes_its_headers_gets_408_and_is_closed():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], header_timeout_s=0.5) as (client,
                                                                                                            base):
            host, port = base.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(PARTIAL_REQUEST)
            answer = await asyncio.wait_for(reader.read(), 30)  # to EOF
            writer.close()
            idle_reader, idle_writer = await asyncio.open_connection(host, int(port))  # not a byte sent
            idle_answer = await asyncio.wait_for(idle_reader.read(), 30)
            idle_writer.close()
        assert answer.startswith(b"HTTP/1.1 408 ") and idle_answer.startswith(b"HTTP/1.1 408 ")
    run(scenario())


def test_a_body_slower_than_its_deadline_gets_408():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], body_timeout_s=0.5) as (client,
                                                                                                          base):
            host, port = base.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": ")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            body = await asyncio.wait_for(reader.readexactly(length), 30)
            writer.close()
        assert head.startswith(b"HTTP/1.1 408 ")
        assert "did not arrive within 0.5 s" in as_json(body)["error"]["message"]
        assert prefill.sent == []
    run(scenario())


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_413(declared):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], max_body_mb=1) as (client, base):
            data = json.dumps(PROMPT | {"prompt": "x" * (1 << 20)}).encode()

            async def chunks():
                for start in range(0, len(data), 1 << 16):
                    yield data[start:start + (1 << 16)]
            async with client.post(base + "/v1/completions", data=data if declared else chunks(),
                                   headers={"Content-Type": "application/json"}) as answer:
                status, raw = answer.status, await answer.read()
            ok, _ = await post(client, base + "/v1/completions", PROMPT | {"prompt": "x" * 1000})
        assert status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE and "1 MiB" in as_json(raw)["error"]["message"]
        assert ok == 200 and len(prefill.sent) == 1
    run(scenario())


def test_the_body_limit_defaults_to_64_mib():
    settings = settings_from_args(build_parser().parse_args(["--prefill", "p:1", "--decode", "d:1"]))
    assert settings.max_body_bytes == 64 << 20 and settings.backend_keepalive_s == 4.0


@pytest.mark.parametrize("body,expected", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (json.dumps(PROMPT | {"prompt": ["one", "two"]}).encode(), "one prompt per request"),
    (json.dumps(PROMPT | {"prompt": [[1, 2], [3, 4], [5]]}).encode(), "a batch of 3 prompts"),
    (json.dumps(PROMPT | {"use_beam_search": True}).encode(), "'use_beam_search' is not supported"),
    (json.dumps(PROMPT | {"best_of": 2}).encode(), "'best_of' must be 1"),
], ids=["deep-array", "deep-prompt", "batch-of-strings", "batch-of-token-lists", "beam-search", "best-of"])
def test_a_body_the_pd_router_cannot_route_is_refused_before_any_instance_sees_it(body, expected):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], health_check_s=0.1) as (client,
                                                                                                          base):
            status, raw = await post(client, base + "/v1/completions", body)
            async with client.get(base + "/health") as health:
                health_status = health.status
        assert status == HTTPStatus.BAD_REQUEST
        error = as_json(raw)["error"]
        assert expected in error["message"] and error["type"] == "invalid_request_error" and error["code"] == 400
        assert prefill.sent == [] and decode.sent == [] and health_status == 200
    run(scenario())


@pytest.mark.parametrize("prompt,single", [(["one"], "one"), ([[1, 2, 3]], [1, 2, 3]), ([1, 2, 3], [1, 2, 3]),
                                           ("text", "text")],
                         ids=["one-string", "one-token-list", "token-ids", "string"])
def test_a_single_prompt_passes_and_a_batch_of_one_is_unwrapped(prompt, single):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            status, _ = await post(client, base + "/v1/completions", PROMPT | {"prompt": prompt})
        assert status == 200
        assert prefill.sent[0].body["prompt"] == single and decode.sent[0].body["prompt"] == single
    run(scenario())


@pytest.mark.parametrize("given,kept", [
    ("r-1_ok:/.~!", True), ("x" * 128, True), ("x" * 129, False), ("x" * 300, False), ("has space", False),
    ("tab\there", False), ("é", False), ("", False), (None, False),
], ids=["printable", "128", "129", "300", "space", "tab", "non-ascii", "empty", "absent"])
def test_a_client_request_id_is_forwarded_only_when_short_and_printable(given, kept, caplog):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            headers = {} if given is None else {"X-Request-Id": given}
            status, _ = await post(client, base + "/v1/completions", PROMPT, **headers)
        assert status == 200
        ids = {prefill.sent[0].headers["X-Request-Id"], decode.sent[0].headers["X-Request-Id"]}
        assert len(ids) == 1
        (used,) = ids
        if kept:
            assert used == given
        else:
            assert len(used) == 32 and int(used, 16) >= 0
            assert (f"request id replaced by {used}" in caplog.text) == (given is not None)
    with caplog.at_level("WARNING", logger="kpool_pd.router.headers"):
        run(scenario())


def test_only_the_allowlisted_client_headers_reach_the_instances():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            status, _ = await post(client, base + "/v1/completions", PROMPT, Authorization="Bearer client",
                                   Cookie="session=1", **{"X-Forwarded-For": "10.0.0.9", "X-Custom": "1",
                                                          "X-Request-Id": "r1"})
        assert status == 200
        for instance in (prefill, decode):
            headers = {name.lower() for name in instance.sent[0].headers}
            assert headers <= {"host", "content-type", "content-length", "accept", "accept-encoding", "user-agent",
                               "authorization", "x-request-id"}, headers
            assert instance.sent[0].headers["Authorization"] == "Bearer client"
    run(scenario())


@pytest.mark.parametrize("backend_key", [None, "backend-secret"], ids=["no-backend-key", "backend-key"])
def test_with_an_api_key_v1_needs_it_and_the_clients_authorization_is_not_forwarded(backend_key):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], api_key="router-secret",
                                                    backend_api_key=backend_key) as (client, base):
            refused = [await post(client, base + path, PROMPT, **headers)
                       for path in ("/v1/completions", "/v1/chat/completions")
                       for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "router-secret"},
                                       {"Authorization": "Bearer router-secret2"})]
            status, _ = await post(client, base + "/v1/completions", PROMPT, Authorization="Bearer router-secret")
            async with client.get(base + "/health") as health, client.get(base + "/metrics") as metrics:
                open_statuses = (health.status, metrics.status)
        assert [s for s, _ in refused] == [401] * 8
        assert {as_json(raw)["error"]["code"] for _, raw in refused} == {401}
        assert status == 200 and open_statuses == (200, 200)
        assert len(prefill.sent) == 1 and len(decode.sent) == 1
        for instance in (prefill, decode):
            expected = None if backend_key is None else f"Bearer {backend_key}"
            assert instance.sent[0].headers.get("Authorization") == expected
    run(scenario())


def test_keys_come_from_the_environment_and_stay_out_of_the_settings_repr(monkeypatch):
    monkeypatch.setenv("KPOOLPD_ROUTER_API_KEY", "env-router")
    monkeypatch.setenv("KPOOLPD_BACKEND_API_KEY", "env-backend")
    monkeypatch.setenv("KPOOLPD_PEER_TOKEN", "env-peer")
    settings = settings_from_args(build_parser().parse_args(["--prefill", "p:1", "--decode", "d:1"]))
    assert (settings.api_key, settings.backend_api_key, settings.peer_token) == ("env-router", "env-backend",
                                                                                 "env-peer")
    flagged = settings_from_args(build_parser().parse_args(["--prefill", "p:1", "--decode", "d:1", "--api-key",
                                                            "flag-router"]))
    assert flagged.api_key == "flag-router"
    assert not any(secret in repr(s) for s in (settings, flagged)
                   for secret in ("env-router", "env-backend", "env-peer", "flag-router"))


@pytest.mark.parametrize("settings,expected", [
    ({"backend_keepalive_s": 0}, "backend_keepalive_s must be positive"),
    ({"header_timeout_s": -1}, "header_timeout_s must be positive"),
    ({"max_body_mb": float("inf")}, "max_body_mb must be positive and finite"),
    ({"max_connections": 0}, "max_connections must be at least 1, got 0"),
    ({"health_check_s": -1}, "health_check_s must not be negative, got -1"),
    ({"api_key": ""}, "api_key must be a non-empty printable ASCII string"),
], ids=["keepalive", "header-timeout", "body-mb", "connections", "health-check", "api-key"])
def test_settings_refuse_limits_that_cannot_work(settings, expected):
    with pytest.raises(ValueError, match=expected):
        RouterSettings(prefill=("http://p",), decode=("http://d",), **settings)
