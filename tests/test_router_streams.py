"""`kpool-pd router`'s decode streams against fakes (tests/router_fakes.py; no vLLM): a client that goes away
stops the decode instance's request; a stream that carries an error or breaks counts as an upstream error."""

from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from tests.router_fakes import (ERROR_EVENT, STREAM_EVENTS, FakeInstance, ReleaseRecorder,  # noqa: E402
                                metric_lines, routed, serving, sse_events)

DEADLINE_S = 60.0
PROMPT = {"model": "m", "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 4, "temperature": 0, "stream": True}
OUTCOMES = 'kpoolpd_router_requests_total{endpoint="/v1/completions",outcome="%s"}'


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


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
            assert events == [STREAM_EVENTS[0], ERROR_EVENT, STREAM_EVENTS[2]]  # passed through as it came
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
