"""Decode steps replayed from CUDA graphs (model.decode_graphs) equal eager steps byte for byte.

Continuous batching over requests of several prompt and output lengths makes the batch grow and shrink
through the buckets (1, 2, 4, 8 requests), the block tables widen, and requests near their end bring fewer
real drafts than num_spec (the graph writes the others past the committed length). Every request's tokens,
output digest and state digest must equal the eager run's. A graphed step synchronises with the host once.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from kpool_pd.kvcache import BlockLayout, CacheFamily, NodeCache
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, run_colocated
from kpool_pd.model.engine import DecodeSequence, Engine, PrefillJob

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def requests(count: int, vocab: int = 1024) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(count):
        prompt_len = [7, 300, 64, 1000, 129, 2, 515, 33, 256, 90][i % 10]
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        out.append(GenerateRequest(request_id=f"r{i}", prompt=tuple(prompt), max_tokens=[40, 3, 17, 64, 1, 25][i % 6]))
    return out


@pytest.mark.parametrize("num_spec", [0, 3])
@pytest.mark.parametrize("kpool", [2, 4])
def test_graphed_decode_equals_eager(num_spec, kpool):
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=4, kpool=kpool, num_spec=num_spec)
    work = requests(13)
    eager = run_colocated(config, work, max_batch=8, device="cuda")
    graphed = run_colocated(config, work, max_batch=8, device="cuda", graph_requests=8)
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]
    assert [r.state_digest for r in graphed] == [r.state_digest for r in eager]
    assert [r.drafts_accepted for r in graphed] == [r.drafts_accepted for r in eager]


def test_a_graphed_step_synchronises_once():
    """After ``capture_graphs`` (every request bucket at the daemon's table width), steps only replay."""
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=4, kpool=4, num_spec=3)
    cache = NodeCache(BlockLayout(config.cache), num_blocks=64, num_rings=4, device="cuda")
    engine = Engine(config, cache.pool, graph_requests=4, graph_table_width=3)
    engine.capture_graphs()
    captured = set(engine.graphs._graphs)
    assert {(b.requests, b.table_width) for b in captured} == {(1, 4), (2, 4), (4, 4)}
    seqs, allocations = [], []
    for i, prompt_len in enumerate((100, 257, 31)):
        allocation = cache.allocate(f"r{i}", config.cache.blocks_for_request(prompt_len, 50))
        allocations.append(allocation)
        prompt = [(7 * i + j) % config.vocab_size for j in range(prompt_len)]
        first = engine.prefill([PrefillJob(prompt=prompt, block_ids=allocation.block_ids, ring_id=allocation.ring_id)])[0]
        seqs.append(DecodeSequence(request_id=f"r{i}", prompt_len=prompt_len, max_tokens=50,
                                   allocation=allocation, output=[first]))
    engine.decode_step(seqs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                engine.decode_step(seqs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        for allocation in allocations:
            allocation.release()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 3, [str(w.message) for w in syncs]
    assert set(engine.graphs._graphs) == captured  # no step captured anew
    assert all(len(s.output) > 4 for s in seqs)
