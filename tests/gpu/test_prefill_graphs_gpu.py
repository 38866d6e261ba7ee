"""Prefill steps replayed from CUDA graphs (model.prefill_graphs) and the hoisted eager prefill equal the per-layer
prefill byte for byte.

Prompts of several lengths are prefilled the way the prefill daemon batches them (the oldest prompts first, at
most T tokens a step, a prompt longer than what is left in a step continuing in the next, from inside a pool):
steps replay a graph, padded to 32, 64 or 96 tokens and to 1, 2 or 4 prompts, hashed where a chunk ends its
prompt; two whole prompts run the hoisted eager forward first (the engine's per-layer prefill is the reference). The first tokens and every byte of both pools must equal the per-layer
engine's. A graphed step synchronises with the host once.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import pytest
import torch

from kpool_pd.kvcache import BlockLayout, CacheFamily, NodeCache
from kpool_pd.model import ModelConfig
from kpool_pd.model.engine import Engine, PrefillJob

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEP_TOKENS = 96


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 300, 64, 2, 131, 96, 33, 200)]


def steps(work: Sequence[tuple[list[int], list[int], int]], budget: int) -> Iterator[list[PrefillJob]]:
    """The prefill daemon's batching of ``work`` (prompt, blocks, ring): the oldest unfinished prompts first, up to
    ``budget`` tokens a step."""
    done = [0] * len(work)
    pending = list(range(len(work)))
    while pending:
        step, left = [], budget
        for i in list(pending):
            if left == 0:
                break
            prompt, blocks, ring = work[i]
            end = min(len(prompt), done[i] + left)
            step.append(PrefillJob(prompt=prompt, block_ids=blocks, ring_id=ring, start=done[i], end=end))
            left -= end - done[i]
            done[i] = end
            if end == len(prompt):
                pending.remove(i)
        yield step


@pytest.mark.parametrize("kpool", [2, 4])
def test_graphed_and_hoisted_prefill_equal_the_per_layer_prefill(monkeypatch, kpool):
    monkeypatch.setattr("kpool_pd.model.prefill_graphs.MIN_GRAPH_TOKENS", 32)  # token buckets of 32, 64 and 96
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=4, kpool=kpool, num_spec=3)
    caches, firsts = [], []
    for graphs in (False, True):
        cache = NodeCache(BlockLayout(config.cache), num_blocks=64, num_rings=8, device="cuda")
        engine = Engine(config, cache.pool, prefill_graph_tokens=STEP_TOKENS if graphs else 0, prefill_graph_requests=4,
                        graph_table_width=2)
        if not graphs:
            engine.hoists = False  # the per-layer forward: the reference
        work, held = [], []
        for i, prompt in enumerate(prompts(config.vocab_size)):
            held.append(cache.allocate(f"r{i}", config.cache.blocks_for_tokens(len(prompt))))
            work.append((prompt, list(held[-1].block_ids), held[-1].ring_id))
        whole = engine.prefill([PrefillJob(prompt=p, block_ids=b, ring_id=r) for p, b, r in work[:2]])
        out, served = list(whole), 0
        for step in steps(work[2:], STEP_TOKENS):
            if graphs and engine.prefill_graphs.serves([(j.prompt[j.start:j.stop], j.start, j.block_ids, j.ring_id)
                                                        for j in step]):
                served += 1
            out.extend(first for first in engine.prefill(step) if first is not None)
        if graphs:
            assert served >= 3
            buckets = engine.prefill_graphs._graphs
            assert {b.requests for b in buckets} >= {1, 2} and {b.hashed for b in buckets} == {False, True}
            assert {b.tokens for b in buckets} >= {64, 96}  # the last step's tokens padded up to a smaller bucket
        for allocation in held:
            allocation.release()
        caches.append(cache)
        firsts.append(out)
    reference, graphed = caches
    assert firsts[1] == firsts[0]
    assert torch.equal(graphed.pool.blocks, reference.pool.blocks)
    assert torch.equal(graphed.pool.rings, reference.pool.rings)


def test_a_graphed_prefill_step_synchronises_once():
    """Hashed (reading its tokens) or not (waiting for its writes to land before its blocks may move)."""
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=4, kpool=4, num_spec=3)
    cache = NodeCache(BlockLayout(config.cache), num_blocks=64, num_rings=4, device="cuda")
    engine = Engine(config, cache.pool, prefill_graph_tokens=STEP_TOKENS, prefill_graph_requests=2, graph_table_width=3)
    engine.capture_prefill_graphs()
    captured = set(engine.prefill_graphs._graphs)
    assert {(b.requests, b.table_width, b.hashed) for b in captured} == {(r, 4, h) for r in (1, 2) for h in (False, True)}
    prompt = [(3 * j + 1) % config.vocab_size for j in range(3 * STEP_TOKENS)]
    held = cache.allocate("r", config.cache.blocks_for_tokens(len(prompt)))
    chunks = [PrefillJob(prompt=prompt, block_ids=held.block_ids, ring_id=held.ring_id, start=s, end=s + STEP_TOKENS)
              for s in range(0, len(prompt), STEP_TOKENS)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs = [engine.prefill([chunk]) for chunk in chunks]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        held.release()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == len(chunks), [str(w.message) for w in syncs]
    assert outputs[:2] == [[None], [None]] and isinstance(outputs[2][0], int)
    assert set(engine.prefill_graphs._graphs) == captured  # no step captured anew
