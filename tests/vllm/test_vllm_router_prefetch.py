"""`kpool-pd router --decode-engine-id` in front of a vLLM producer and consumer (KpoolPdConnector over UCX), as a
user runs them: the router names the consumer in each prefill (``prefetch_by``), the producer announces the grant
to it, and the consumer pulls it before the decode request arrives. An OpenAI client's greedy completions equal the
consumer's own, the consumer computes none of the prompts, and its /metrics count the loads served from prefetched
bytes (``vllm:kpool_pd_prefetch_hits_total``) and the producer's the grants it announced."""

from __future__ import annotations

import os
import random
import secrets

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")
openai = pytest.importorskip("openai", reason="the OpenAI client comes with vLLM")
pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'kpool-pd[router]')")

from kpool_pd.bench import vllm_engines  # noqa: E402
from kpool_pd.connector import ucx_available  # noqa: E402
from tests.support import vllm_servers  # noqa: E402
from tests.support.memory_share import module_memory  # noqa: E402
from tests.support.polling import wait_for  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.stopping import stop_servers  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800),  # vLLM servers start slowly on a loaded 2-core machine
              pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (pip install 'kpool-pd[ucx]')")]

connector = vllm_engines.kpool_transfer_config
CONSUMER_ENGINE_ID = "router-prefetch-consumer"
PROMPT_LENGTHS = (7, 17, 100, 257, 1000)
MAX_TOKENS = 8
CLIENT_TIMEOUT_S = 300
WARM_UP_S = 600
COUNTED_S = 60  # the connector's counters reaching vLLM's /metrics (collected at its next steps)

# two servers and the router: about 4.5 GiB with this process, as tests/vllm/test_vllm_router.py's
vllm_memory = module_memory(3, "tests/vllm/test_vllm_router_prefetch.py's servers")


@pytest.fixture(scope="module")
def deployment(vllm_memory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-router-prefetch")
    model = str(vllm_engines.write_model(folder / "model"))
    token = {"KPOOLPD_PEER_TOKEN": secrets.token_hex(16)}
    servers = []
    try:
        producer = vllm_servers.vllm_server("producer", model, free_port(), connector(
            "kv_producer", {"listen": f"127.0.0.1:{free_port()}", "transport": "ucx", "lease_s": 120}), folder, **token)
        servers.append(producer)
        consumer = vllm_servers.vllm_server("consumer", model, free_port(), connector(
            "kv_consumer", {"transport": "ucx", "integrity": True, "producers": ["127.0.0.1"]},
            kv_load_failure_policy="recompute", engine_id=CONSUMER_ENGINE_ID), folder, **token)
        servers.append(consumer)
        router = vllm_servers.router_server(free_port(), [producer.url], [consumer.url], folder,
                                            "--decode-engine-id", f"{consumer.url}={CONSUMER_ENGINE_ID}")
        servers.append(router)
        for server in servers:
            server.wait_healthy()
        warm_up(router, consumer)
        yield producer, consumer, router
    finally:
        stop_servers(servers)


def client(server: vllm_servers.Server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=CLIENT_TIMEOUT_S, max_retries=0)


def complete(server: vllm_servers.Server, prompt: list[int]) -> list[int]:
    answer = client(server).completions.create(model=vllm_servers.SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0.0, extra_body={"return_token_ids": True,
                                                                            "ignore_eos": True})
    assert answer.choices[0].finish_reason == "length", answer
    return list(answer.choices[0].token_ids)


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def prefetch_hits(consumer: vllm_servers.Server) -> float:
    return vllm_servers.counter(consumer.metrics(), "vllm:kpool_pd_prefetch_hits_total")


def warm_up(router: vllm_servers.Server, consumer: vllm_servers.Server) -> None:
    """Requests through the router until one was served from prefetched bytes (the consumer has handshaken with the
    producer and follows its announcements)."""
    def prefetched() -> bool:
        before = prefetch_hits(consumer)
        complete(router, prompts(1, [7])[0])
        return wait_for(lambda: prefetch_hits(consumer) > before, 5, period_s=0.5)
    assert wait_for(prefetched, WARM_UP_S, period_s=1.0), f"no load was prefetched in {WARM_UP_S} s:\n{consumer.tail()}"


def test_completions_through_the_router_are_prefetched_and_equal_one_server(deployment):
    producer, consumer, router = deployment
    asked = prompts(31, PROMPT_LENGTHS)
    before = vllm_servers.prompt_tokens_by_source(consumer.metrics())
    hits = prefetch_hits(consumer)
    announced = vllm_servers.counter(producer.metrics(), "vllm:kpool_pd_grants_announced_total")
    pd = [complete(router, prompt) for prompt in asked]
    after = vllm_servers.prompt_tokens_by_source(consumer.metrics())
    assert wait_for(lambda: prefetch_hits(consumer) - hits == len(asked), COUNTED_S, period_s=0.5), \
        f"{prefetch_hits(consumer) - hits} of {len(asked)} loads served from prefetched bytes"
    assert wait_for(lambda: vllm_servers.counter(producer.metrics(), "vllm:kpool_pd_grants_announced_total")
                    - announced == len(asked), COUNTED_S, period_s=0.5)
    single = [complete(consumer, prompt) for prompt in asked]
    grew = {source: after[source] - before.get(source, 0.0) for source in after}
    assert grew.get("local_compute", 0.0) == 0, f"the consumer computed prompt tokens: {grew}"
    assert grew["external_kv_transfer"] == sum(PROMPT_LENGTHS)
    for prompt, one, two in zip(asked, single, pd):
        assert two == one, f"{len(prompt)}-token prompt: through the router {two}, one server {one}"
