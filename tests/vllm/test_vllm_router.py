"""`kpool-pd router` in front of vLLM OpenAI servers (producers and a consumer, KpoolPdConnector over the
gRPC stream):

- an OpenAI client's greedy completions of prompts given as token ids equal one server's alone, streamed
  or not, and the consumer computes none of those prompts (vLLM's ``vllm:prompt_tokens_by_source`` counter
  on its /metrics). The single-server reference is the consumer itself after the PD requests, asked with
  no kv_transfer_params; it has prefix caching off, so its PD requests found their KV only in the pull;
- a producer killed mid-pull (stopped after its prefill, killed once the consumer's load is in progress):
  the consumer's pull fails, vLLM recomputes the prompt (kv_load_failure_policy "recompute"; the same
  tokens), and the consumer holds no block afterwards (vLLM's ``vllm:kv_cache_usage_perc``);
- a consumer killed while its request is in flight (before, during or after its pull, from a second
  producer started then, which it has not pulled from before): that producer holds no block once the
  grant's lease ran out, and still serves.

The tests run in this order on one deployment (the second kills the router's producer, the last the
consumer). The router's producer has a long lease: on a loaded 2-core machine a consumer's first
Handshake and its pulls can take many seconds, and the fixture sends requests until one pull succeeded
(the Handshake done) before the tests count anything."""

from __future__ import annotations

import os
import random
import secrets
import signal
import threading

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")
openai = pytest.importorskip("openai", reason="the OpenAI client comes with vLLM")
pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from kpool_pd.bench import vllm_engines
from tests.support import vllm_servers  # noqa: E402
from tests.support.memory_share import module_memory  # noqa: E402
from tests.support.polling import wait_for  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.stopping import stop_servers  # noqa: E402

# vLLM servers start, warm up and serve on a loaded 2-core machine: well past the suite's 300 s.
connector = vllm_engines.kpool_transfer_config  # KpoolPdConnector's kv_transfer_config
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

PROMPT_LENGTHS = (7, 17, 100, 257, 1000)
MAX_TOKENS = 8
CLIENT_TIMEOUT_S = 300
LEASE_S = 120  # the router's producer
SHORT_LEASE_S = 10  # the second producer's
FREED_WITHIN_S = SHORT_LEASE_S + 60  # the lease, and a loaded machine's engine steps
WARM_UP_S = 600
FETCH_SEEN_S = 60  # the decode request reaches the consumer's scheduler and its pull starts


class Deployment:
    """A producer, a consumer and the router in front of them, healthy; more producers on demand (at most
    two vLLM servers run at once on the 2-core machine). Stops every server it started, all at once."""

    def __init__(self, folder, model: str) -> None:
        self.folder, self.model = folder, model
        self.token = {"KPOOLPD_PEER_TOKEN": secrets.token_hex(16)}
        self.servers: list[vllm_servers.Server] = []

    def start_producer(self, name: str, lease_s: int) -> vllm_servers.Server:
        return self._started(vllm_servers.vllm_server(name, self.model, free_port(), connector(
            "kv_producer", {"listen": f"127.0.0.1:{free_port()}", "transport": "grpc", "lease_s": lease_s}),
            self.folder, **self.token))

    def start(self) -> None:
        self.producer = self.start_producer("producer", LEASE_S)
        self.consumer = self._started(vllm_servers.vllm_server("consumer", self.model, free_port(), connector(
            "kv_consumer", {"transport": "grpc", "integrity": True, "producers": ["127.0.0.1"]},
            kv_load_failure_policy="recompute"),
            self.folder, **self.token))
        self.router = self._started(vllm_servers.router_server(free_port(), [self.producer.url], [self.consumer.url],
                                                               self.folder))
        for server in self.servers:
            server.wait_healthy()
        warm_up(self.router, self.consumer)

    def _started(self, server: vllm_servers.Server) -> vllm_servers.Server:
        self.servers.append(server)
        return server

    def stop(self) -> None:
        stop_servers(self.servers)


# two servers, a second producer in one test, the router: 4.5 GiB at the file's peak with this process (2026-12-07)
vllm_memory = module_memory(3, "tests/vllm/test_vllm_router.py's servers")


@pytest.fixture(scope="module")
def deployment(vllm_memory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-router")
    deployment = Deployment(folder, str(vllm_engines.write_model(folder / "model")))
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()


def client(server: vllm_servers.Server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=CLIENT_TIMEOUT_S, max_retries=0)


def complete(openai_client, prompt: list[int], *, stream: bool = False, **extra) -> list[int]:
    """The greedy completion's token ids."""
    extra |= {"return_token_ids": True, "ignore_eos": True}
    answer = openai_client.completions.create(model=vllm_servers.SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                              temperature=0.0, stream=stream, extra_body=extra)
    if not stream:
        assert answer.choices[0].finish_reason == "length", answer
        return list(answer.choices[0].token_ids)
    tokens = []
    for chunk in answer:
        for choice in chunk.choices:
            tokens += choice.token_ids or []
    return tokens


def prefill(producer: vllm_servers.Server, prompt: list[int]) -> dict:
    """A one-token prefill of ``prompt`` on ``producer``; the kv_transfer_params a decode needs."""
    answer = vllm_servers.post_json(producer.url + "/v1/completions", {
        "model": vllm_servers.SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}})
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt), params
    return params


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def holds_no_block(server: vllm_servers.Server) -> bool:
    return vllm_servers.kv_cache_usage(server.metrics()) == 0.0


def warm_up(router: vllm_servers.Server, consumer: vllm_servers.Server) -> None:
    """Requests through the router until one was pulled rather than recomputed."""
    def pulled() -> bool:
        before = vllm_servers.prompt_tokens_by_source(consumer.metrics()).get("external_kv_transfer", 0.0)
        complete(client(router), prompts(1, [7])[0])
        return vllm_servers.prompt_tokens_by_source(consumer.metrics())["external_kv_transfer"] > before
    assert wait_for(pulled, WARM_UP_S, period_s=1.0), f"no pull succeeded in {WARM_UP_S} s:\n{consumer.tail()}"


def test_completions_through_the_router_equal_one_server(deployment):
    consumer = deployment.consumer
    asked = prompts(25, PROMPT_LENGTHS)

    before = vllm_servers.prompt_tokens_by_source(consumer.metrics())
    pulls_before = vllm_servers.counter(consumer.metrics(), "vllm:kpool_pd_pulls_total")
    pd = [complete(client(deployment.router), prompt, stream=index % 2 == 1) for index, prompt in enumerate(asked)]
    after = vllm_servers.prompt_tokens_by_source(consumer.metrics())
    # the connector's own counters reach vLLM's /metrics (KVConnectorStats), collected at its next steps
    assert wait_for(lambda: vllm_servers.counter(consumer.metrics(), "vllm:kpool_pd_pulls_total") - pulls_before
                    == len(asked), FETCH_SEEN_S, period_s=0.5), consumer.metrics()[-3000:]
    single = [complete(client(consumer), prompt) for prompt in asked]

    grew = {source: after[source] - before.get(source, 0.0) for source in after}
    assert grew.get("local_compute", 0.0) == 0, f"the consumer computed prompt tokens: {grew}"
    assert grew["external_kv_transfer"] == sum(PROMPT_LENGTHS)
    for prompt, one, two in zip(asked, single, pd):
        assert len(one) == MAX_TOKENS
        assert two == one, f"{len(prompt)}-token prompt: through the router {two}, one server {one}"
    counted = vllm_servers.prompt_tokens_by_source(consumer.metrics())
    assert counted["local_compute"] - after["local_compute"] == sum(PROMPT_LENGTHS)
    assert wait_for(lambda: holds_no_block(consumer) and holds_no_block(deployment.producer), FREED_WITHIN_S)


def test_a_producer_killed_mid_pull_leaves_the_consumer_to_recompute(deployment):
    """The producer stops answering (SIGSTOP) after its prefill; the consumer's pull starts and waits for its
    bytes (vLLM counts the load in progress); then the producer is killed (SIGKILL)."""
    doomed, consumer = deployment.producer, deployment.consumer
    [prompt] = prompts(26, [300])
    params = prefill(doomed, prompt)
    assert not holds_no_block(doomed)  # the grant holds the prompt's blocks
    before = vllm_servers.prompt_tokens_by_source(consumer.metrics())
    doomed.kill(signal.SIGSTOP)
    answer: dict[str, list[int]] = {}

    def decode() -> None:
        answer["tokens"] = complete(client(consumer), prompt, kv_transfer_params=params)
    sender = threading.Thread(target=decode, daemon=True)
    sender.start()
    try:
        assert wait_for(lambda: vllm_servers.kv_fetches_in_progress(consumer.metrics()) >= 1, FETCH_SEEN_S,
                        period_s=0.2), f"the consumer's pull did not start within {FETCH_SEEN_S} s:\n{consumer.tail()}"
    finally:
        doomed.kill()  # SIGKILL, stopped or not
    doomed.wait_gone()
    sender.join(CLIENT_TIMEOUT_S)

    after = vllm_servers.prompt_tokens_by_source(consumer.metrics())
    assert after["local_compute"] - before["local_compute"] == len(prompt)  # the load failed; vLLM computed it
    assert answer["tokens"] == complete(client(consumer), prompt)
    assert wait_for(lambda: holds_no_block(consumer), FREED_WITHIN_S)
    assert consumer.healthy()


def test_a_consumer_killed_with_its_request_in_flight_lets_the_producer_free_by_lease(deployment):
    consumer = deployment.consumer
    producer = deployment.start_producer("second_producer", SHORT_LEASE_S)
    producer.wait_healthy()
    [prompt] = prompts(27, [900])
    params = prefill(producer, prompt)
    assert not holds_no_block(producer)

    def decode() -> None:
        try:
            complete(client(consumer), prompt, kv_transfer_params=params)
        except openai.APIError:
            pass  # the consumer dies under it
    sender = threading.Thread(target=decode, daemon=True)
    sender.start()
    consumer.kill()
    consumer.wait_gone()
    sender.join(CLIENT_TIMEOUT_S)

    assert wait_for(lambda: holds_no_block(producer), FREED_WITHIN_S, period_s=0.5), (
        f"the producer still holds blocks {FREED_WITHIN_S} s after its consumer died:\n{producer.tail()}")
    assert prefill(producer, prompt)["remote_num_tokens"] == len(prompt)  # and still serves
