"""`kpool-pd router` toward its instances, against fakes (tests/support/router_fakes.py; no vLLM): the keep-alive race
with a backend's idle timeout, what marks an instance failed and what does not, bursts, silent and dead
backends, the health probes and the retry on a role's only instance."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from kpool_pd.router.settings import DEFAULT_BACKEND_KEEPALIVE_S  # noqa: E402
from tests.support.polling import until  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.router_fakes import (FakeInstance, IdleClosingProxy, as_json, metric_lines, post, routed,  # noqa: E402
                                serving, silent_backend)

DEADLINE_S = 120.0
PROMPT = {"model": "m", "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 4, "temperature": 0}
BACKEND_IDLE_S = 0.2  # the fake backends' keep-alive idle timeout (vLLM's is 5 s)
LARGE_PROMPT = "x" * (2 << 20)  # a 2 MiB body: still being written when the backend's reset comes


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


async def health(client, base: str) -> tuple[int, dict]:
    async with client.get(base + "/health") as answer:
        return answer.status, await answer.json()


def by_url(report: dict) -> dict[str, dict]:
    return {i["url"]: i for i in report["instances"]}


def test_the_backend_keepalive_default_is_under_vllms_idle_timeout():
    assert DEFAULT_BACKEND_KEEPALIVE_S < 5.0


def test_requests_racing_a_backends_idle_close_are_sent_again_on_a_fresh_connection():
    """A small request, a pause as long as the backend's idle timeout, then a 2 MiB body, 30 times: the
    pooled connection of each large request is reset under it, at both roles; none fails, neither
    instance is marked failed."""
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), IdleClosingProxy(prefill.url, BACKEND_IDLE_S) as p, \
                IdleClosingProxy(decode.url, BACKEND_IDLE_S) as d, routed([p.url], [d.url]) as (client, base):
            statuses = []
            for _ in range(30):
                statuses.append((await post(client, base + "/v1/completions", PROMPT))[0])
                await asyncio.sleep(BACKEND_IDLE_S * 1.5)  # past the backend's idle timeout: it has closed
                statuses.append((await post(client, base + "/v1/completions", PROMPT | {"prompt": LARGE_PROMPT}))[0])
            status, report = await health(client, base)
            metrics = await metric_lines(client, base)
        assert statuses == [200] * 60
        assert p.resets >= 30 and d.resets >= 30  # the race was met, every time
        assert status == 200 and {i["state"] for i in report["instances"]} == {"up"}
        assert [i["last_failure"] for i in report["instances"]] == [None, None]
        assert not [line for line in metrics if line.startswith("kpoolpd_router_instance_failures_total")]
    run(scenario())


def test_a_keepalive_under_the_backends_idle_timeout_never_meets_the_race():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), IdleClosingProxy(prefill.url, BACKEND_IDLE_S * 2) as p, \
                IdleClosingProxy(decode.url, BACKEND_IDLE_S * 2) as d, \
                routed([p.url], [d.url], backend_keepalive_s=BACKEND_IDLE_S) as (client, base):
            for _ in range(5):
                assert (await post(client, base + "/v1/completions", PROMPT))[0] == 200
                await asyncio.sleep(BACKEND_IDLE_S * 3)
                assert (await post(client, base + "/v1/completions", PROMPT | {"prompt": LARGE_PROMPT}))[0] == 200
        assert (p.resets, d.resets) == (0, 0)  # the router closed each idle connection first
    run(scenario())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_instance_refusing_with_4xx_is_not_marked_failed(role):
    async def scenario():
        prefill = FakeInstance("p0", fail_status=422 if role == "prefill" else 0)
        decode = FakeInstance("d0", fail_status=422 if role == "decode" else 0)
        async with serving(prefill, decode), routed([prefill.url], [decode.url], health_check_s=0.1) as (client, base):
            for _ in range(3):
                status, raw = await post(client, base + "/v1/completions", PROMPT)
                assert (status, as_json(raw)) == (422, {"error": {"message": f"{role[0]}0 says no"}})
            status, report = await health(client, base)
            metrics = await metric_lines(client, base)
        assert status == 200 and [i["last_failure"] for i in report["instances"]] == [None, None]
        assert not [line for line in metrics if line.startswith("kpoolpd_router_instance_failures_total")]
        assert len((prefill if role == "prefill" else decode).sent) == 3  # no second try either
    run(scenario())


def test_a_burst_of_200_requests_all_succeed():
    async def scenario():
        prefills, decodes = [FakeInstance(f"p{i}") for i in range(2)], [FakeInstance(f"d{i}") for i in range(2)]
        async with serving(*prefills, *decodes), routed([p.url for p in prefills], [d.url for d in decodes]) as (
                client, base):
            answers = await asyncio.gather(*(post(client, base + "/v1/completions", PROMPT | {"stream": i % 2 == 1})
                                             for i in range(200)))
            status, _ = await health(client, base)
        assert [s for s, _ in answers] == [200] * 200 and status == 200
        assert sum(len(d.sent) for d in decodes) == 200 and min(len(d.sent) for d in decodes) > 0
    run(scenario())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_silent_backend_is_given_up_by_its_timeout_and_a_dead_one_skipped(role):
    async def scenario():
        good = {"prefill": FakeInstance("p0"), "decode": FakeInstance("d0")}
        async with serving(*good.values()), silent_backend() as silent:
            dead = closed_url()
            urls = {r: [good[r].url] for r in good} | {role: [silent, dead, good[role].url]}
            async with routed(urls["prefill"], urls["decode"], prefill_timeout_s=0.5, decode_timeout_s=0.5) as (
                    client, base):
                loop = asyncio.get_running_loop()
                started = loop.time()
                status, raw = await post(client, base + "/v1/completions", PROMPT)
                took = loop.time() - started
                _, report = await health(client, base)
        assert status == 200 and as_json(raw)["served_by"] == "d0"
        assert 0.5 <= took < 0.5 + 20  # the silent one's timeout, then the others
        instances = by_url(report)
        assert instances[silent]["last_failure"]["reason"] == "no answer within 0.5 s"
        assert "ClientConnectorError" in instances[dead]["last_failure"]["reason"]
        assert instances[good[role].url]["state"] == "up"
    run(scenario())


def test_a_dead_instance_shows_down_in_health_before_any_request():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode):
            dead = closed_url()
            async with routed([prefill.url, dead], [decode.url], health_check_s=0.1) as (client, base):
                async def dead_is_down():
                    return by_url((await health(client, base))[1])[dead]["state"] == "down"
                await until(dead_is_down, "the dead prefill instance marked down", timeout_s=30)
                status, report = await health(client, base)
        assert status == 200  # another prefill instance is up
        assert by_url(report)[dead]["last_failure"]["reason"].startswith("GET /health: ClientConnectorError")
        assert prefill.sent == [] and decode.sent == []
    run(scenario())


def test_an_instance_whose_probe_fails_is_down_with_the_reason_and_up_when_it_answers_again():
    async def scenario():
        prefill, decode = FakeInstance("p0", health_status=503), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], health_check_s=0.1) as (
                client, base):
            async def unhealthy():
                return (await health(client, base))[0] == HTTPStatus.SERVICE_UNAVAILABLE
            await until(unhealthy, "the prefill instance marked down", timeout_s=30)
            _, report = await health(client, base)
            prefill.health_status = 200

            async def healthy():
                return (await health(client, base))[0] == HTTPStatus.OK
            await until(healthy, "the prefill instance marked up again", timeout_s=30)
            _, after = await health(client, base)
        assert report["reason"] == "no instance is up for prefill"
        assert by_url(report)[prefill.url]["state"] == "down"
        assert by_url(report)[prefill.url]["last_failure"]["reason"] == "GET /health: HTTP 503"
        assert by_url(after)[prefill.url]["state"] == "up"
        assert by_url(after)[prefill.url]["last_failure"]["reason"] == "GET /health: HTTP 503"  # still on record
    run(scenario())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_roles_only_instance_is_tried_once_more_after_a_pause(role):
    async def scenario():
        flaky = FakeInstance(f"{role[0]}0", fail_status=503, fail_times=1)
        other = FakeInstance("d0" if role == "prefill" else "p0")
        prefill, decode = (flaky, other) if role == "prefill" else (other, flaky)
        async with serving(prefill, decode), routed([prefill.url], [decode.url], retry_pause_s=0.2) as (client, base):
            status, raw = await post(client, base + "/v1/completions", PROMPT)
        assert status == 200, raw
        assert len(flaky.sent) == 2
    run(scenario())


def test_a_roles_only_instance_is_not_tried_a_third_time():
    async def scenario():
        prefill, decode = FakeInstance("p0", fail_status=503), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], retry_pause_s=0.05) as (client,
                                                                                                          base):
            status, raw = await post(client, base + "/v1/completions", PROMPT)
        assert status == HTTPStatus.BAD_GATEWAY and as_json(raw)["error"]["message"].count(prefill.url) == 2
        assert len(prefill.sent) == 2 and decode.sent == []
    run(scenario())
