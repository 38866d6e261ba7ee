"""`kpool-pd router` against fake OpenAI servers (tests/support/router_fakes.py; no vLLM): the two halves of a PD
request, the choice of instance by fewest outstanding requests, skipping an instance that fails (and
naming it when all failed), streaming passed through as it arrives, the errors, /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
from http import HTTPStatus

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from kpool_pd.router.instances import InstancePool, Role  # noqa: E402
from kpool_pd.router.main import main as router_main  # noqa: E402
from kpool_pd.router.settings import RouterSettings  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.router_fakes import (STREAM_EVENTS, FakeInstance, as_json, last_body, post, serving,  # noqa: E402
                                sse_events)
from tests.support.router_fakes import routed as router  # noqa: E402

DEADLINE_S = 30.0
PROMPT = {"model": "m", "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 4, "temperature": 0}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
def test_a_request_is_prefilled_for_one_token_then_decoded_with_the_returned_params(path):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), router([prefill.url], [decode.url]) as (client, base):
            body = PROMPT | {"stream_options": {"include_usage": True}, "min_tokens": 2, "max_completion_tokens": 4}
            status, raw = await post(client, base + path, body, Authorization="Bearer k", **{"X-Request-Id": "r1"})
        assert status == 200 and as_json(raw)["served_by"] == "d0"
        sent_prefill, sent_decode = prefill.sent[0], decode.sent[0]
        assert sent_prefill.body == PROMPT | {"max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                                              "kv_transfer_params": {"do_remote_decode": True}}
        assert sent_decode.body == body | {"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p0",
                                                                  "remote_request_id": "r1"}}
        for sent in (sent_prefill, sent_decode):
            assert sent.headers["Authorization"] == "Bearer k" and sent.headers["X-Request-Id"] == "r1"
    run(scenario())


def test_the_instance_with_fewest_outstanding_requests_is_chosen():
    async def scenario():
        gate = asyncio.Event()
        prefill, busy, idle = FakeInstance("p0"), FakeInstance("d0", stream_gate=gate), FakeInstance("d1")
        async with serving(prefill, busy, idle), router([prefill.url], [busy.url, idle.url]) as (client, base):
            async with client.post(base + "/v1/completions", json=PROMPT | {"stream": True}) as streaming:
                assert await streaming.content.readuntil(b"\n\n") == STREAM_EVENTS[0]  # d0 holds one request now
                for _ in range(3):
                    status, raw = await post(client, base + "/v1/completions", PROMPT)
                    assert status == 200 and as_json(raw)["served_by"] == "d1"
                gate.set()
                assert await streaming.read() == b"".join(STREAM_EVENTS[1:])
            status, raw = await post(client, base + "/v1/completions", PROMPT)  # both idle: the one picked longest ago
            assert as_json(raw)["served_by"] == "d0"
        assert (len(busy.sent), len(idle.sent)) == (2, 3)
    run(scenario())


def test_pool_prefers_fewest_outstanding_then_not_failed_lately_then_least_recently_picked():
    now = [100.0]
    pool = InstancePool(Role.DECODE, ("http://a", "http://b", "http://c"), cooldown_s=10, clock=lambda: now[0])
    a, b, c = pool.instances
    assert [pool.choose().url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    with pool.outstanding(b), pool.outstanding(c):
        assert pool.choose().url == "http://a"
        assert pool.choose(skip={"http://a"}).url == "http://b"
    pool.failed(a, "HTTP 500")
    assert [pool.choose().url for _ in range(2)] == ["http://c", "http://b"] and pool.usable() == 2
    assert pool.choose(skip={"http://b", "http://c"}) is a  # failed lately, but the only one left
    now[0] += 10
    assert pool.usable() == 3 and (a.outstanding, b.outstanding, c.outstanding) == (0, 0, 0)
    assert pool.choose(skip={"http://a", "http://b", "http://c"}) is None


def test_a_prefill_instance_that_fails_is_skipped_and_tried_last_afterwards():
    async def scenario():
        broken, prefill, decode = FakeInstance("p0", fail_status=500), FakeInstance("p1"), FakeInstance("d0")
        gone = closed_url()
        async with serving(broken, prefill, decode), router([gone, broken.url, prefill.url], [decode.url]) as (client,
                                                                                                              base):
            for _ in range(3):
                status, raw = await post(client, base + "/v1/completions", PROMPT)
                assert status == 200, raw
            async with client.get(base + "/metrics") as answer:
                metrics = (await answer.text()).splitlines()
        assert len(broken.sent) == 1 and len(prefill.sent) == 3  # after failing once, tried last
        assert {last_body(decode)["kv_transfer_params"]["remote_engine_id"]} == {"p1"}
        for url in (gone, broken.url):
            assert f'kpoolpd_router_instance_failures_total{{instance="{url}",role="prefill"}} 1.0' in metrics
        assert 'kpoolpd_router_requests_total{endpoint="/v1/completions",outcome="ok"} 3.0' in metrics
    run(scenario())


def test_a_decode_instance_that_fails_is_skipped():
    async def scenario():
        prefill, broken, decode = FakeInstance("p0"), FakeInstance("d0", fail_status=503), FakeInstance("d1")
        async with serving(prefill, broken, decode), router([prefill.url], [broken.url, decode.url]) as (client, base):
            status, raw = await post(client, base + "/v1/completions", PROMPT)
        assert status == 200 and as_json(raw)["served_by"] == "d1"
        assert last_body(broken)["kv_transfer_params"] == last_body(decode)["kv_transfer_params"]
    run(scenario())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_when_every_instance_of_a_role_fails_the_502_names_each(role):
    async def scenario():
        good = {"prefill": FakeInstance("p0"), "decode": FakeInstance("d0")}
        broken, hung, gone = FakeInstance("x0", fail_status=500), FakeInstance("x1", hang=True), closed_url()
        async with serving(good["prefill"], good["decode"], broken, hung):
            urls = {r: [good[r].url] for r in good} | {role: [broken.url, hung.url, gone]}
            async with router(urls["prefill"], urls["decode"], prefill_timeout_s=0.5, decode_timeout_s=0.5) as (
                    client, base):
                status, raw = await post(client, base + "/v1/completions", PROMPT)
                async with client.get(base + "/health") as health:
                    health_status, instances = health.status, (await health.json())["instances"]
        assert status == HTTPStatus.BAD_GATEWAY
        message = as_json(raw)["error"]["message"]
        assert message.startswith(f"every {role} instance failed: ")
        assert f"{broken.url} (HTTP 500" in message and "x0 says no" in message
        assert f"{hung.url} (no answer within 0.5 s)" in message
        assert f"{gone} (ClientConnectorError" in message
        assert health_status == HTTPStatus.SERVICE_UNAVAILABLE
        failed = {i["url"]: i for i in instances if i["state"] == "failed"}
        assert sorted(failed) == sorted([broken.url, hung.url, gone])
        assert failed[hung.url]["last_failure"]["reason"] == "no answer within 0.5 s"
        assert 0 <= failed[gone]["last_failure"]["seconds_ago"] < DEADLINE_S
        if role == "decode":
            assert len(good["prefill"].sent) == 1
    run(scenario())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_decode_5xx_after_the_prefill_is_named_as_a_likely_kv_transfer_failure(stream):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d" * 300, fail_status=500)
        async with serving(prefill, decode), router([prefill.url], [decode.url], retry_pause_s=0.05) as (client, base):
            status, raw = await post(client, base + "/v1/completions", PROMPT | {"stream": stream})
        assert status == HTTPStatus.BAD_GATEWAY
        answer = json.dumps({"error": {"message": f"{'d' * 300} says no"}})  # what the instance answered
        why = (f"{decode.url} (HTTP 500: it failed the request after its prefill on {prefill.url}, e.g. its KV "
               f"transfer failed or timed out; it answered {answer[:200]})")
        message = as_json(raw)["error"]["message"]
        assert message == f"every decode instance failed: {why}; {why}"  # its only instance, tried twice
        assert "\n" not in message and len(prefill.sent) == 1
    run(scenario())


def test_a_stream_is_passed_through_as_it_arrives():
    async def scenario():
        gate = asyncio.Event()
        prefill, decode = FakeInstance("p0"), FakeInstance("d0", stream_gate=gate)
        async with serving(prefill, decode), router([prefill.url], [decode.url]) as (client, base):
            async with client.post(base + "/v1/completions", json=PROMPT | {"stream": True}) as answer:
                assert answer.status == 200 and answer.content_type == "text/event-stream"
                first = await answer.content.readuntil(b"\n\n")  # before the instance sent the rest
                gate.set()
                rest = await answer.read()
        assert sse_events(first + rest) == STREAM_EVENTS
        assert last_body(prefill)["stream"] is False and last_body(decode)["stream"] is True
    run(scenario())


def test_a_stream_the_decode_instance_breaks_off_ends_with_an_error_event():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0", break_stream=True)
        async with serving(prefill, decode), router([prefill.url], [decode.url]) as (client, base):
            async with client.post(base + "/v1/completions", json=PROMPT | {"stream": True}) as answer:
                events = sse_events(await answer.read())
            async with client.get(base + "/metrics") as answer:
                metrics = await answer.text()
        assert events[0] == STREAM_EVENTS[0] and len(events) == 2
        assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == 502
        assert 'kpoolpd_router_requests_total{endpoint="/v1/completions",outcome="upstream_error"} 1.0' in metrics
    run(scenario())


@pytest.mark.parametrize("body,expected", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "must be a JSON object, not list"),
    (json.dumps(PROMPT | {"stream": "yes"}).encode(), "'stream' must be true or false, got 'yes'"),
    (json.dumps(PROMPT | {"n": 2}).encode(), "'n' must be 1"),
], ids=["not-json", "not-an-object", "stream-not-bool", "n-above-1"])
def test_a_bad_request_is_refused_before_any_instance_sees_it(body, expected):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), router([prefill.url], [decode.url]) as (client, base):
            status, raw = await post(client, base + "/v1/completions", body)
        assert status == HTTPStatus.BAD_REQUEST and expected in as_json(raw)["error"]["message"]
        assert prefill.sent == [] and decode.sent == []
    run(scenario())


def test_an_instance_refusal_reaches_the_client_as_it_is_and_no_other_is_tried():
    async def scenario():
        refusing, other, decode = FakeInstance("p0", fail_status=400), FakeInstance("p1"), FakeInstance("d0")
        async with serving(refusing, other, decode), router([refusing.url, other.url], [decode.url]) as (client, base):
            status, raw = await post(client, base + "/v1/completions", PROMPT)
        assert (status, as_json(raw)) == (400, {"error": {"message": "p0 says no"}})
        assert other.sent == [] and decode.sent == []
    run(scenario())


def test_a_prefill_instance_without_kv_transfer_params_is_named():
    async def scenario():
        plain, decode = FakeInstance("p0", no_params=True), FakeInstance("d0")
        async with serving(plain, decode), router([plain.url], [decode.url]) as (client, base):
            status, raw = await post(client, base + "/v1/completions", PROMPT)
        message = as_json(raw)["error"]["message"]
        assert status == HTTPStatus.BAD_GATEWAY and f"{plain.url} (its answer carries no kv_transfer_params" in message
        assert decode.sent == []
    run(scenario())


def test_health_is_ok_with_a_usable_instance_of_each_role():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), router([prefill.url], [decode.url]) as (client, base):
            async with client.get(base + "/health") as answer:
                assert answer.status == 200
                report = await answer.json()
        assert report["status"] == "ok"
        instances = [(i["role"], i["url"], i["state"], i["outstanding"], i["last_failure"]) for i in report["instances"]]
        assert instances == [("prefill", prefill.url, "up", 0, None), ("decode", decode.url, "up", 0, None)]
    run(scenario())


@pytest.mark.parametrize("settings,expected", [
    ({"prefill": (), "decode": ("http://d",)}, "at least one prefill instance"),
    ({"prefill": ("http://p",), "decode": ("d:1", "http://d:1/")}, "listed twice"),
    ({"prefill": ("ftp://p",), "decode": ("http://d",)}, "is not http(s)://HOST[:PORT]"),
    ({"prefill": ("http://p/v1/completions",), "decode": ("http://d",)}, "give the server's root"),
    ({"prefill": ("http://p",), "decode": ("http://d",), "prefill_timeout_s": 0}, "prefill_timeout_s must be positive"),
], ids=["no-prefill", "duplicate", "scheme", "path", "timeout"])
def test_settings_refuse_what_cannot_work(settings, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        RouterSettings(**settings)


def test_settings_normalise_instance_urls():
    settings = RouterSettings(prefill=("10.0.0.1:8100", "http://p:8100/v1"), decode=("https://d/",))
    assert settings.prefill == ("http://10.0.0.1:8100", "http://p:8100") and settings.decode == ("https://d",)


def test_the_command_refuses_bad_flags_with_a_message(capsys):
    assert router_main(["--prefill", "ftp://p", "--decode", "http://d"]) == 2
    assert "error: instance URL 'ftp://p' is not http(s)://HOST[:PORT]" in capsys.readouterr().err


def test_a_decode_instance_with_an_engine_id_is_planned_before_the_prefill_and_named_to_it():
    async def scenario():
        prefill, d0, d1 = FakeInstance("p0"), FakeInstance("d0"), FakeInstance("d1")
        async with serving(prefill, d0, d1), router([prefill.url], [d0.url, d1.url], decode_engine_ids=(
                (d0.url, "engine-d0"), (d1.url, "engine-d1"))) as (client, base):
            served = []
            for _ in range(4):
                status, raw = await post(client, base + "/v1/completions", PROMPT)
                assert status == 200, raw
                served.append(as_json(raw)["served_by"])
        named = [sent.body["kv_transfer_params"] for sent in prefill.sent]
        assert [p["prefetch_by"] for p in named] == [f"engine-{d}" for d in served], (named, served)
        assert set(served) == {"d0", "d1"}  # still chosen by load: both served
    run(scenario())


def test_a_planned_decode_that_fails_leaves_the_request_to_the_next_one():
    async def scenario():
        prefill, broken, decode = FakeInstance("p0"), FakeInstance("d0", fail_status=503), FakeInstance("d1")
        async with serving(prefill, broken, decode), router([prefill.url], [broken.url, decode.url],
                                                           decode_engine_ids=((broken.url, "engine-d0"),)) as (
                client, base):
            status, raw = await post(client, base + "/v1/completions", PROMPT)
        assert status == 200 and as_json(raw)["served_by"] == "d1"
        assert prefill.sent[0].body["kv_transfer_params"] == {"do_remote_decode": True, "prefetch_by": "engine-d0"}
        assert len(broken.sent) == 1  # planned and tried first
    run(scenario())


def test_without_engine_ids_the_prefill_names_no_decode():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), router([prefill.url], [decode.url]) as (client, base):
            status, _ = await post(client, base + "/v1/completions", PROMPT)
        assert status == 200 and prefill.sent[0].body["kv_transfer_params"] == {"do_remote_decode": True}
    run(scenario())


@pytest.mark.parametrize("flags, message", [
    (["--decode-engine-id", "http://10.0.0.9:8000=e9"], "not a decode instance given by URL"),
    (["--decode-engine-id", "http://10.0.0.2:8000"], "takes URL=ENGINE_ID"),
    (["--decode-engine-id", "http://10.0.0.2:8000=" + "x" * 300], "1 to 250 printable ASCII characters"),
    (["--decode-engine-id", "http://10.0.0.2:8000=a", "--decode-engine-id", "http://10.0.0.2:8000=b"], "twice"),
], ids=["unknown_url", "no_engine_id", "too_long", "twice"])
def test_bad_decode_engine_ids_are_refused_naming_the_value(flags, message, capsys):
    argv = ["--prefill", "http://10.0.0.1:8000", "--decode", "http://10.0.0.2:8000", *flags]
    assert router_main(argv) == 2
    assert message in capsys.readouterr().err
