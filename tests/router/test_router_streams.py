"""`kpool-pd router`'s decode streams against fakes (tests/support/router_fakes.py; no vLLM): a client that goes away
stops the decode instance's request; a stream that carries an error or breaks counts as an upstream error; a
5xx error event names the decode and prefill instances and the likely cause; events are passed on whole,
however they are cut into chunks."""

from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from tests.support.router_fakes import (STREAM_EVENTS, FakeInstance, ReleaseRecorder, metric_lines, routed,  # noqa: E402
                                serving, sse_events)

DEADLINE_S = 60.0
PROMPT = {"model": "m", "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 4, "temperature": 0, "stream": True}
OUTCOMES = 'kpoolpd_router_requests_total{endpoint="/v1/completions",outcome="%s"}'


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def error_of(event: bytes) -> dict:
    return json.loads(event.removeprefix(b"data: "))["error"]


def test_a_streaming_client_that_goes_away_closes_the_decode_instances_request():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0", hold_stream=True)
        releases = ReleaseRecorder()
        async with serving(prefill, decode), routed([prefill.url], [decode.url], release_grant=releases) as (_, base):
            async with aiohttp.ClientSession() as leaving:
                answer = await leaving.post(base + "/v1/completions", json=PROMPT)
                assert await answer.content.readuntil(b"\n\n") == STREAM_EVENTS[0]
                answer.close()  # the client goes away mid-stream
            await asyncio.wait_for(decode.closed_mid_stream.wait(), 30)  # the fake fails itself after 30 s too
        assert releases.calls == []  # the decode had answered: it pulled the KV
    run(scenario())


@pytest.mark.parametrize("fault", ["error-event", "broken"])
def test_a_stream_that_fails_midway_counts_as_an_upstream_error(fault):
    async def scenario():
        prefill = FakeInstance("p0")
        decode = FakeInstance("d0", stream_error=fault == "error-event", break_stream=fault == "broken")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            async with client.post(base + "/v1/completions", json=PROMPT) as answer:
                status, events = answer.status, sse_events(await answer.read())
            lines = await metric_lines(client, base)
        assert status == 200 and events[0] == STREAM_EVENTS[0]
        if fault == "error-event":
            assert events[0::2] == [STREAM_EVENTS[0], STREAM_EVENTS[2]] and len(events) == 3
            assert "it said: pull failed" in error_of(events[1])["message"]
        else:
            assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == 502
        assert f"{OUTCOMES % 'upstream_error'} 1.0" in lines
        assert not [line for line in lines if line.startswith(OUTCOMES % "ok")]
    run(scenario())


def test_a_whole_stream_counts_as_ok():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            async with client.post(base + "/v1/completions", json=PROMPT) as answer:
                events = sse_events(await answer.read())
            lines = await metric_lines(client, base)
        assert events == STREAM_EVENTS and f"{OUTCOMES % 'ok'} 1.0" in lines
    run(scenario())


@pytest.mark.parametrize("first", [True, False], ids=["before-any-token", "after-a-token"])
def test_a_5xx_error_event_names_the_instances_and_the_likely_cause(first):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0", fail_stream=first, stream_error=not first)
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            async with client.post(base + "/v1/completions", json=PROMPT) as answer:
                status, events = answer.status, sse_events(await answer.read())
            lines = await metric_lines(client, base)
        assert status == 200 and events[-1] == STREAM_EVENTS[2] and len(events) == (2 if first else 3)
        error = error_of(events[-2])
        assert (error["type"], error["code"]) == ("InternalServerError", 500)  # vLLM's, kept
        assert error["message"] == (f"the decode instance {decode.url} failed the request after its prefill on "
                                    f"{prefill.url}, e.g. its KV transfer failed or timed out; it said: pull failed")
        assert f"{OUTCOMES % 'upstream_error'} 1.0" in lines
    run(scenario())


def test_an_error_event_under_500_passes_through_as_it_came():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0", fail_stream=True, error_code=400)
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            async with client.post(base + "/v1/completions", json=PROMPT) as answer:
                events = sse_events(await answer.read())
        assert error_of(events[0]) == {"message": "pull failed", "type": "InternalServerError", "code": 400}
    run(scenario())


@pytest.mark.parametrize("chunks", [
    [b'data: {"choices": [{"text": "a"}]}\r\n', b'\r\ndata: {"cho', b'ices": [{"text": "b"}]}\r\n\r\n',
     b"data: [DONE]\r\n\r\n"],
    [b"d", b"ata: ", b'{"choices": [{"text": "a"}]}\n', b"\ndata: [DONE]"],
    [b": keep-alive\n\n" + b"".join(STREAM_EVENTS)],
], ids=["crlf-split-events", "byte-split-unterminated-end", "comment-and-all-at-once"])
def test_events_reach_the_client_whole_however_the_instance_cuts_them(chunks):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0", stream_chunks=chunks)
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            async with client.post(base + "/v1/completions", json=PROMPT) as answer:
                raw = await answer.read()
            lines = await metric_lines(client, base)
        assert raw == b"".join(chunks)
        assert f"{OUTCOMES % 'ok'} 1.0" in lines  # [DONE] was seen, cut or not
    run(scenario())
