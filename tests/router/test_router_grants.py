"""`kpool-pd router` releases the prefill's grant when its decode cannot happen, against fakes
(tests/support/router_fakes.py; no vLLM) and a recording releaser in place of ``grants.GrantReleaser``."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from tests.support.polling import until  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.router_fakes import FakeInstance, ReleaseRecorder, metric_lines, post, routed, serving  # noqa: E402

DEADLINE_S = 60.0
PROMPT = {"model": "m", "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 4, "temperature": 0}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def params_of(prefill: FakeInstance, request_id: str) -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": prefill.name, "remote_request_id": request_id}


@pytest.mark.parametrize("decodes,expected_status", [
    ([{"fail_status": 503}, {"fail_status": 500}], HTTPStatus.BAD_GATEWAY),
    (["unreachable"], HTTPStatus.BAD_GATEWAY),
    ([{"fail_status": 400}], HTTPStatus.BAD_REQUEST),
], ids=["every-decode-5xx", "decode-unreachable", "decode-refuses-4xx"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_grant_is_released_when_no_decode_answered(decodes, expected_status, stream):
    async def scenario():
        prefill = FakeInstance("p0")
        fakes = [FakeInstance(f"d{i}", **d) for i, d in enumerate(decodes) if d != "unreachable"]
        releases = ReleaseRecorder()
        async with serving(prefill, *fakes):
            urls = [f.url for f in fakes] + [f"http://127.0.0.1:{free_port()}" for d in decodes if d == "unreachable"]
            async with routed([prefill.url], urls, release_grant=releases, retry_pause_s=0) as (client, base):
                status, _ = await post(client, base + "/v1/completions", PROMPT | {"stream": stream},
                                       **{"X-Request-Id": "r1"})
                lines = await metric_lines(client, base)
        assert status == expected_status
        assert releases.calls == [(params_of(prefill, "r1"), "r1")]
        assert 'kpoolpd_router_grants_released_total{released="true"} 1.0' in lines
    run(scenario())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_grant_is_not_released_when_a_decode_answered(stream):
    async def scenario():
        prefill, broken, decode = FakeInstance("p0"), FakeInstance("d0", fail_status=503), FakeInstance("d1")
        releases = ReleaseRecorder()
        async with serving(prefill, broken, decode), routed([prefill.url], [broken.url, decode.url],
                                                            release_grant=releases) as (client, base):
            for _ in range(3):
                status, _ = await post(client, base + "/v1/completions", PROMPT | {"stream": stream})
                assert status == 200
        assert releases.calls == [] and len(broken.sent) == 1
    run(scenario())


def test_the_grant_is_not_released_when_the_prefill_failed():
    async def scenario():
        prefill, decode = FakeInstance("p0", fail_status=500), FakeInstance("d0")
        releases = ReleaseRecorder()
        async with serving(prefill, decode), routed([prefill.url], [decode.url], release_grant=releases,
                                                    retry_pause_s=0) as (client, base):
            status, _ = await post(client, base + "/v1/completions", PROMPT)
        assert status == HTTPStatus.BAD_GATEWAY and releases.calls == []
    run(scenario())


def test_the_grant_is_released_when_the_client_leaves_before_a_decode_answered():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0", hang=True)
        releases = ReleaseRecorder()
        async with serving(prefill, decode), routed([prefill.url], [decode.url], release_grant=releases) as (_, base):
            async with aiohttp.ClientSession() as leaving:
                request = asyncio.ensure_future(leaving.post(base + "/v1/completions", json=PROMPT,
                                                             headers={"X-Request-Id": "r2"}))

                async def decode_asked():
                    return bool(decode.sent)
                await until(decode_asked, "the decode instance asked", timeout_s=30)
                request.cancel()  # the client goes away while the decode has not answered
            await until(_called(releases), "the grant released", timeout_s=30)
        assert releases.calls == [(params_of(prefill, "r2"), "r2")]
    run(scenario())


def _called(releases: ReleaseRecorder):
    async def called() -> bool:
        return bool(releases.calls)
    return called


def test_without_an_override_the_router_releases_through_grants_grant_releaser(caplog):
    """build_app's default releaser is kpool_pd.router.grants.GrantReleaser: the fake prefill's params name
    no producer grant, so it answers False and says so."""
    from kpool_pd.router.app import build_app, serving as router_serving
    from kpool_pd.router.settings import RouterSettings

    async def scenario():
        prefill = FakeInstance("p0")
        async with serving(prefill):
            settings = RouterSettings(prefill=(prefill.url,), decode=(f"http://127.0.0.1:{free_port()}",), port=0,
                                      health_check_s=0, retry_pause_s=0, peer_token="fleet-secret")
            async with router_serving(settings, build_app(settings)) as base, aiohttp.ClientSession() as client:
                status, _ = await post(client, base + "/v1/completions", PROMPT, **{"X-Request-Id": "r3"})
                lines = await metric_lines(client, base)
        assert status == HTTPStatus.BAD_GATEWAY
        assert 'kpoolpd_router_grants_released_total{released="false"} 1.0' in lines
        assert "request r3: its kv_transfer_params name no grant to release" in caplog.text
        assert "fleet-secret" not in caplog.text
    with caplog.at_level("INFO"):
        run(scenario())
