"""`kpool-pd router`'s endpoints besides a PD request, against fakes (tests/support/router_fakes.py; no vLLM):
``/v1/models`` (the ``openai`` client's ``models.list()``), ``/version``, ``/tokenize`` and ``/detokenize``
passed through to a decode instance as it answers them, skipping one that fails and naming each when none
answers; what the router does not serve answered 404 or 405 in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from tests.support.ports import free_port  # noqa: E402
from tests.support.router_fakes import MODEL, VERSION_TYPE, FakeInstance, as_json, routed, serving  # noqa: E402

DEADLINE_S = 60.0
SERVED = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /version", "POST /tokenize",
          "POST /detokenize", "GET /health", "GET /metrics"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


async def ask(client, method: str, url: str, body: dict | None = None, **headers) -> tuple[int, bytes, str | None]:
    """(status, body, Content-Type) of one request."""
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers.setdefault("Content-Type", "application/json")
    async with client.request(method, url, data=data, headers=headers) as answer:
        return answer.status, await answer.read(), answer.headers.get("Content-Type")


async def instance_states(client, base: str) -> dict[str, str]:
    async with client.get(base + "/health") as answer:
        return {i["url"]: i["state"] for i in (await answer.json())["instances"]}


@pytest.mark.parametrize("router_key", [None, "router-secret"], ids=["no-key", "router-key"])
def test_the_openai_clients_models_list_goes_through_the_router(router_key):
    openai = pytest.importorskip("openai")

    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], api_key=router_key) as (_, base):
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=router_key or "client-key", max_retries=0,
                                        timeout=DEADLINE_S / 2)
            async with client:
                models = await client.models.list()
                if router_key is not None:
                    wrong = client.with_options(api_key="wrong")
                    with pytest.raises(openai.AuthenticationError):
                        await wrong.models.list()
        assert [(m.id, m.object, m.owned_by) for m in models.data] == [(MODEL, "model", "vllm")]
        assert prefill.sent == [] and [s.path for s in decode.sent] == ["/v1/models"]
        forwarded = decode.sent[0].headers
        assert forwarded.get("Authorization") == (None if router_key else "Bearer client-key")
        assert len(forwarded["X-Request-Id"]) == 32  # the router's own, the client sent none
    run(scenario())


@pytest.mark.parametrize("method,path,body,expected,content_type", [
    ("GET", "/v1/models", None, {"object": "list"}, "application/json; charset=utf-8"),
    ("GET", "/version", None, {"version": "0.0.0+d0"}, VERSION_TYPE),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "hi!"},
     {"count": 3, "max_model_len": 2048, "tokens": [104, 105, 33], "token_strs": None},
     "application/json; charset=utf-8"),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [104, 105]}, {"prompt": "hi"}, "application/json; charset=utf-8"),
], ids=["models", "version", "tokenize", "detokenize"])
def test_a_passed_request_reaches_one_decode_instance_and_its_answer_the_client_as_it_is(method, path, body,
                                                                                        expected, content_type):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            answer = await ask(client, method, base + path, body, Authorization="Bearer k", Cookie="c=1",
                               **{"X-Request-Id": "r-pass"})
            async with client.get(base + "/metrics") as metrics:
                lines = (await metrics.text()).splitlines()
        status, raw, answered_type = answer
        assert (status, answered_type) == (200, content_type)
        assert as_json(raw).items() >= expected.items()
        assert prefill.sent == [] and len(decode.sent) == 1
        sent = decode.sent[0]
        assert (sent.path, sent.body) == (path, body)  # the client's body as it came
        assert sent.headers["Authorization"] == "Bearer k" and sent.headers["X-Request-Id"] == "r-pass"
        assert "Cookie" not in sent.headers
        assert f'kpoolpd_router_requests_total{{endpoint="{path}",outcome="ok"}} 1.0' in lines
    run(scenario())


def test_the_version_body_passes_byte_for_byte():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            _, through_router, _ = await ask(client, "GET", base + "/version")
            _, direct, _ = await ask(client, "GET", decode.url + "/version")
        assert through_router == direct
    run(scenario())


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})],
                         ids=["tokenize", "detokenize"])
def test_a_decode_instances_refusal_passes_through_and_marks_nothing(path, body):
    async def scenario():
        prefill, decode, other = FakeInstance("p0"), FakeInstance("d0", no_tokenizer=True), FakeInstance("d1")
        async with serving(prefill, decode, other), routed([prefill.url], [decode.url, other.url]) as (client, base):
            status, raw, content_type = await ask(client, "POST", base + path, body)
            states = await instance_states(client, base)
        assert (status, content_type) == (400, "application/json; charset=utf-8")
        assert as_json(raw)["message"].startswith("Unable to get tokenizer") and as_json(raw)["code"] == 400
        assert other.sent == [] and set(states.values()) == {"up"}
    run(scenario())


def test_with_an_api_key_models_needs_it_and_the_others_are_open_as_on_vllm():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url], api_key="router-secret",
                                                    backend_api_key="backend-secret") as (client, base):
            refused = await ask(client, "GET", base + "/v1/models")
            models = await ask(client, "GET", base + "/v1/models", Authorization="Bearer router-secret")
            version = await ask(client, "GET", base + "/version")
        assert refused[0] == HTTPStatus.UNAUTHORIZED and as_json(refused[1])["error"]["code"] == 401
        assert models[0] == 200 and version[0] == 200
        assert [s.path for s in decode.sent] == ["/v1/models", "/version"]
        assert {s.headers["Authorization"] for s in decode.sent} == {"Bearer backend-secret"}
    run(scenario())


def test_a_decode_instance_that_cannot_answer_is_skipped_for_the_next():
    async def scenario():
        prefill, broken, decode = FakeInstance("p0"), FakeInstance("d0", fail_status=503), FakeInstance("d1")
        gone = closed_url()
        async with serving(prefill, broken, decode), routed([prefill.url], [gone, broken.url, decode.url]) as (
                client, base):
            status, raw, _ = await ask(client, "GET", base + "/v1/models")
            states = await instance_states(client, base)
        assert status == 200 and as_json(raw)["data"][0]["id"] == MODEL
        assert len(broken.sent) == 1 and len(decode.sent) == 1
        assert (states[gone], states[broken.url], states[decode.url]) == ("failed", "failed", "up")
    run(scenario())


@pytest.mark.parametrize("method,path,body", [("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "x"})],
                         ids=["models", "tokenize"])
def test_when_no_decode_instance_answers_the_502_names_each(method, path, body):
    async def scenario():
        prefill = FakeInstance("p0")
        broken, hung, gone = FakeInstance("d0", fail_status=500), FakeInstance("d1", hang=True), closed_url()
        async with serving(prefill, broken, hung), routed([prefill.url], [broken.url, hung.url, gone],
                                                          decode_timeout_s=0.5) as (client, base):
            status, raw, content_type = await ask(client, method, base + path, body)
        assert (status, content_type) == (HTTPStatus.BAD_GATEWAY, "application/json; charset=utf-8")
        error = as_json(raw)["error"]
        assert error["type"] == "upstream_error" and error["code"] == 502
        assert error["message"].startswith(f"no decode instance answered {method} {path}: ")
        assert f"{broken.url} (HTTP 500: " in error["message"] and "d0 says no" in error["message"]
        assert f"{hung.url} (no answer within 0.5 s)" in error["message"]
        assert f"{gone} (ClientConnectorError" in error["message"]
        assert prefill.sent == []
    run(scenario())


@pytest.mark.parametrize("method,path", [("POST", "/v1/embeddings"), ("POST", "/v1/responses"), ("GET", "/foo"),
                                         ("GET", "/v1/models/tiny-llama"), ("GET", "/")],
                         ids=["embeddings", "responses", "foo", "model-by-id", "root"])
def test_a_path_the_router_does_not_serve_gets_an_openai_404_listing_what_it_serves(method, path):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            status, raw, content_type = await ask(client, method, base + path, {} if method == "POST" else None)
        assert (status, content_type) == (HTTPStatus.NOT_FOUND, "application/json; charset=utf-8")
        error = as_json(raw)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", 404)
        assert error["message"] == f"the router does not serve {method} {path}; it serves {', '.join(SERVED)}"
        assert prefill.sent == [] and decode.sent == []
    run(scenario())


def test_the_openai_clients_call_to_an_unserved_endpoint_fails_with_the_routers_message():
    openai = pytest.importorskip("openai")

    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (_, base):
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0,
                                          timeout=DEADLINE_S / 2) as client:
                with pytest.raises(openai.NotFoundError) as refused:
                    await client.embeddings.create(model=MODEL, input="hi")
        assert "the router does not serve POST /v1/embeddings; it serves " in str(refused.value)
        assert decode.sent == []
    run(scenario())


def test_a_long_unserved_path_is_quoted_cut_short():
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            status, raw, _ = await ask(client, "GET", base + "/" + "x" * 1000)
        message = as_json(raw)["error"]["message"]
        assert status == 404 and f"GET /{'x' * 199}...; it serves" in message and "x" * 200 not in message
    run(scenario())


@pytest.mark.parametrize("method,path,allowed", [
    ("GET", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"), ("POST", "/v1/models", "GET"),
    ("GET", "/tokenize", "POST"), ("DELETE", "/health", "GET"),
], ids=["get-completions", "put-chat", "post-models", "get-tokenize", "delete-health"])
def test_a_wrong_method_on_a_served_path_gets_an_openai_405(method, path, allowed):
    async def scenario():
        prefill, decode = FakeInstance("p0"), FakeInstance("d0")
        async with serving(prefill, decode), routed([prefill.url], [decode.url]) as (client, base):
            async with client.request(method, base + path) as answer:
                status, raw, allow = answer.status, await answer.read(), answer.headers.get("Allow")
        assert status == HTTPStatus.METHOD_NOT_ALLOWED and allowed in allow.split(", ")
        error = as_json(raw)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", 405)
        assert error["message"] == f"{path} takes {allowed}, not {method}; the router serves {', '.join(SERVED)}"
        assert prefill.sent == [] and decode.sent == []
    run(scenario())
