"""kpool-pd inside vLLM: a producer and a consumer engine (``KpoolPdConnector``) in two processes give the
same greedy tokens as one engine alone, over UCX and over the gRPC stream, and the consumer computes none
of the prompt: vLLM's own ``vllm:prompt_tokens_by_source`` counter on the consumer grows by every prompt
token under ``external_kv_transfer`` and by none under ``local_compute``. (A request's
``num_cached_tokens`` does not say this: for a ``do_remote_prefill`` request vLLM reports the producer's
prefix-cache hits there.) The consumer runs the PD requests before it ever computes those prompts itself,
so its blocks cannot already hold their KV: equal tokens mean the pulled bytes were right."""

from __future__ import annotations

import os
import random
import re
import secrets
from pathlib import Path

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.bench import vllm_engines  # noqa: E402
from tests.support.engine_context import engine_context  # noqa: E402
from tests.support.memory_share import module_memory  # noqa: E402
from tests.support.polling import wait_for  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.stopping import stop_engines  # noqa: E402

connector = vllm_engines.kpool_transfer_config  # KpoolPdConnector's kv_transfer_config
pytestmark = pytest.mark.vllm

PROMPT_LENGTHS = (7, 9, 16, 17, 100, 257, 640, 1000)
MAX_TOKENS = 8
LOGGED_S = 30  # a consumer's log line reaching its file


FAILURE_POLICY = {"ucx": "recompute", "grpc": "fail"}  # vLLM's kv_load_failure_policy, one of each
CONSUMER_ENGINE_IDS = {"ucx": "pd-test-consumer-ucx", "grpc": "pd-test-consumer-grpc"}  # what a proxy names


def start_engines(model: str, logs: Path):
    """A producer and a consumer per transport for ``model``, each consumer's output in ``logs``; yields
    (producer, {transport: consumer})."""
    token = secrets.token_hex(16)
    context = engine_context()
    started = []
    listen = f"127.0.0.1:{free_port()}"
    try:
        producer = vllm_engines.EngineProcess(context, model, connector("kv_producer", {"listen": listen,
                                                                  "peer_token": token, "lease_s": 60}))
        started.append(producer)
        consumers = {}
        for transport in ("ucx", "grpc"):
            settings = {"peer_token": token, "transport": transport, "integrity": True, "producers": [listen]}
            consumers[transport] = vllm_engines.EngineProcess(context, model, connector(
                "kv_consumer", settings, kv_load_failure_policy=FAILURE_POLICY[transport],
                engine_id=CONSUMER_ENGINE_IDS[transport]), log=logs / f"consumer-{transport}.log")
            started.append(consumers[transport])
        for engine in started:
            engine.wait_ready()
        yield producer, consumers
    finally:
        stop_engines(started)


# both fixtures' six engines live until the module ends: 8.7 GiB at the file's peak with this process (2026-12-07)
vllm_memory = module_memory(7, "tests/vllm/test_vllm_pd.py's engines")


@pytest.fixture(scope="module")
def engines(vllm_memory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    yield from start_engines(str(vllm_engines.write_model(folder / "model")), folder)


@pytest.fixture(scope="module")
def hybrid_engines(vllm_memory, tmp_path_factory):
    """The model with a sliding-window layer and a full-attention one: two KV cache groups."""
    folder = tmp_path_factory.mktemp("tiny-hybrid")
    yield from start_engines(str(vllm_engines.write_model(folder / "model", layers=vllm_engines.HYBRID_LAYERS)), folder)


def check_pd_equals_single_engine(producer, consumer, seed: int, groups: int, prefill: dict | None = None,
                                  after_prefill=None) -> None:
    """PROMPT_LENGTHS prompts through producer and consumer give the consumer's own tokens, the consumer
    computing none of the prompts; the params carry one block list per KV cache group. ``prefill``: the
    prefill requests' kv_transfer_params (default: do_remote_decode alone); ``after_prefill()`` runs between the
    prefill and the decode requests."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]
    total = sum(PROMPT_LENGTHS)

    prefilled = producer.run(prompts, 1, [prefill or {"do_remote_decode": True} for _ in prompts])
    params = [p for _, _, p in prefilled.outputs]
    assert all(p and p["do_remote_prefill"] and p["remote_num_tokens"] == len(q) for p, q in zip(params, prompts))
    assert all(len(p["remote_block_ids"]) == groups for p in params), [len(p["remote_block_ids"]) for p in params]
    if after_prefill is not None:
        after_prefill()
    decoded = consumer.run(prompts, MAX_TOKENS, params)
    alone = consumer.run(prompts, MAX_TOKENS)  # no params: the engine computes the prompts itself

    assert alone.prompt_tokens["local_compute"] == total  # the counter counts what the engine computes
    assert decoded.prompt_tokens["local_compute"] == 0, f"the consumer computed {decoded.prompt_tokens}"
    assert decoded.prompt_tokens["external_kv_transfer"] == total
    for prompt, (single, _, _), (pd, _, _) in zip(prompts, alone.outputs, decoded.outputs):
        assert len(single) == MAX_TOKENS
        assert pd == single, f"{len(prompt)}-token prompt: PD gave {pd}, one engine {single}"


@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_pd_equals_single_engine(engines, transport):
    producer, consumers = engines
    check_pd_equals_single_engine(producer, consumers[transport], seed=len(transport), groups=1)


@pytest.mark.parametrize("model", ["engines", "hybrid_engines"], ids=["one-group", "two-groups"])
def test_pd_with_the_consumer_named_prefetches_and_equals_single_engine(request, model):
    """The proxy names the consumer in the prefill requests (prefetch_by): the producer announces each grant, the
    consumer pulls it before its request comes and lands it from those bytes; the tokens are one engine's, the
    consumer computes none of the prompts. The prefetch was the grants' pull: the producer's blocks are all free
    again before any decode request was sent (without it they stay held until the decode requests pull them)."""
    producer, consumers = request.getfixturevalue(model)
    consumer = consumers["ucx"]
    warm = producer.run([[5, 6, 7]], 1, [{"do_remote_decode": True}]).outputs[0][2]
    consumer.run([[5, 6, 7]], 1, [warm])  # the consumer has handshaken: it follows the producer's announcements
    free = producer.free_blocks()
    assert free is not None, "the producer's engine core runs in another process: its blocks cannot be counted"

    def all_prefetched():
        assert wait_for(lambda: producer.free_blocks() == free, LOGGED_S), \
            f"the producer still holds {free - producer.free_blocks()} blocks: the grants were not prefetched"
    check_pd_equals_single_engine(producer, consumer, seed=11, groups=2 if model == "hybrid_engines" else 1,
                                  prefill={"do_remote_decode": True, "prefetch_by": CONSUMER_ENGINE_IDS["ucx"]},
                                  after_prefill=all_prefetched)


@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_hybrid_pd_equals_single_engine(hybrid_engines, transport):
    """Sliding-window and full-attention layers (vLLM's hybrid KV cache manager, two groups): the full
    group's prompt blocks and the sliding group's in-window blocks land, and the tokens are one engine's."""
    producer, consumers = hybrid_engines
    check_pd_equals_single_engine(producer, consumers[transport], seed=len(transport), groups=2)


@pytest.mark.parametrize("model", ["engines", "hybrid_engines"], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_a_failed_load_is_recomputed_or_fails_the_request(request, model, transport):
    """A decode request whose grant is gone (its params sent a second time: the first pull released it)
    does not hang: the pull fails, the request is reported failed (by request, never by block ids: vLLM
    cannot map those back with two KV cache groups, and its engine died of them), and vLLM recomputes the
    prompt (kv_load_failure_policy "recompute": one engine's tokens) or ends the request with an error
    ("fail"). The engine serves on."""
    producer, consumers = request.getfixturevalue(model)
    consumer = consumers[transport]
    prompts = [[random.Random(7).randrange(3, 1000) for _ in range(40)]]
    prefilled = producer.run(prompts, 1, [{"do_remote_decode": True}])
    params = [p for _, _, p in prefilled.outputs]
    first = consumer.run(prompts, MAX_TOKENS, [dict(p) for p in params])
    assert first.prompt_tokens["local_compute"] == 0 and first.outputs[0][1] == "length"

    again = consumer.run(prompts, MAX_TOKENS, [dict(p) for p in params])  # the grant was released
    tokens, finish_reason, _ = again.outputs[0]
    if FAILURE_POLICY[transport] == "recompute":
        assert (tokens, finish_reason) == (first.outputs[0][0], "length")
    else:
        assert finish_reason == "error" and len(tokens) < MAX_TOKENS
    policy = FAILURE_POLICY[transport]  # the consumer's log says what vLLM did about it
    said = re.compile(rf"KV transfer of request \S+ failed, .*kv_load_failure_policy '{policy}'")
    assert wait_for(lambda: said.search(consumer.log.read_text(errors="replace")), LOGGED_S), \
        consumer.log.read_text(errors="replace")[-2000:]
    again = consumer.run(prompts, MAX_TOKENS)  # the engine lives on
    assert again.outputs[0][0] == first.outputs[0][0] and again.outputs[0][1] == "length"
