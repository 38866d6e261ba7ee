"""What the decode and prefill graphs decide on the host (their replay is tests/gpu/test_decode_graphs_gpu.py's):
the buckets a step is padded to, the engines they refuse, and the forwards they capture, run on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kpool_pd.kvcache import BlockLayout, CacheFamily, CachePool
from kpool_pd.model import ModelConfig
from kpool_pd.model.graph_capture import bucket_size, request_buckets
from kpool_pd.model.prefill_graphs import PrefillBucket, PrefillStepGraph, prefill_bucket, token_buckets
from kpool_pd.model.batch import build_batch
from kpool_pd.model.engine import Engine, PrefillJob


def test_buckets_are_the_next_power_of_two():
    assert [bucket_size(n) for n in (0, 1, 2, 3, 4, 5, 16, 17, 64)] == [1, 1, 2, 4, 4, 8, 16, 32, 64]
    assert [request_buckets(n) for n in (1, 2, 5, 16)] == [[1], [1, 2], [1, 2, 4, 5], [1, 2, 4, 8, 16]]


@pytest.mark.parametrize("family", list(CacheFamily), ids=lambda f: f.value)
def test_a_cpu_engine_refuses_graphs(family):
    config = ModelConfig.build(family=family, num_layers=1)
    pool = CachePool(BlockLayout(config.cache), num_blocks=2, num_rings=1, device=torch.device("cpu"))
    for graphs, served in ((dict(graph_requests=4), "decode graphs serve pools"),
                           (dict(prefill_graph_tokens=64), "prefill graphs serve kpool pools")):
        with pytest.raises(ValueError, match=f"{served} on CUDA; this engine's pool is {family.value} on cpu"):
            Engine(config, pool, **graphs)


@pytest.mark.parametrize("num_spec", [0, 3])
def test_the_forward_a_graph_captures_writes_and_hashes_what_the_eager_forward_does(num_spec):
    """``Engine._graphed_forward`` (every layer's inputs at once, MLA rows once) on the CPU against the eager
    forward, on two pools prefilled alike: the same hashes and the same cache bytes (padded requests, which the
    CPU reference refuses for their ring -1, are tests/gpu/test_decode_graphs_gpu.py's)."""
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=3, kpool=4, num_spec=num_spec, mla_entry_bytes=40)
    engines = []
    for _ in range(2):
        pool = CachePool(BlockLayout(config.cache), num_blocks=8, num_rings=3, device=torch.device("cpu"))
        engine = Engine(config, pool)
        engine.prefill([PrefillJob(prompt=[(5 * i + 3) % 1000 for i in range(n)], block_ids=[2 * b, 2 * b + 1],
                                   ring_id=b) for b, n in enumerate((9, 300, 64))])
        engines.append(engine)
    k = 1 + num_spec
    chunks = [([7] * k, 9, [0, 1], 0), ([11] * k, 300, [2, 3], 1), ([13] * k, 64, [4, 5], 2)]
    batch = build_batch(chunks, last_only=False, device=torch.device("cpu"))
    eager, graphed = engines
    want = eager._decode_forward(batch)
    got = graphed._graphed_forward(batch)
    assert torch.equal(got, want)
    assert torch.equal(graphed.pool.blocks, eager.pool.blocks)
    assert torch.equal(graphed.pool.rings, eager.pool.rings)


@pytest.mark.parametrize("token_layers", [40, 1 << 17], ids=["runs of a layer or two", "every layer at once"])
def test_the_hoisted_prefill_forward_writes_and_hashes_what_the_per_layer_forward_does(monkeypatch, token_layers):
    """``Engine._hoisted_forward`` with the prefill update (what a prefill graph captures, and a CUDA engine's eager
    prefill) against ``_write`` then ``_hashes``: three chunks of which two end their prompt, one starting inside a
    pool, on two pools prefilled alike up to them; the same hashes and the same cache bytes."""
    monkeypatch.setattr("kpool_pd.model.engine.HOIST_TOKEN_LAYERS", token_layers)
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=3, kpool=4, num_spec=1, mla_entry_bytes=40)
    prompts = [[(7 * i + 1) % 1000 for i in range(n)] for n in (30, 300, 21)]
    firsts = (9, 256, 0)  # where the chunks begin; the earlier tokens are prefilled before
    engines = []
    for _ in range(2):
        pool = CachePool(BlockLayout(config.cache), num_blocks=8, num_rings=3, device=torch.device("cpu"))
        engine = Engine(config, pool)
        engine.prefill([PrefillJob(prompt=p, block_ids=[2 * b, 2 * b + 1], ring_id=b, end=first)
                        for b, (p, first) in enumerate(zip(prompts, firsts)) if first])
        engines.append(engine)
    ends = (20, 300, 21)
    chunks = [(p[first:end], first, [2 * b, 2 * b + 1], b) for b, (p, first, end) in enumerate(zip(prompts, firsts, ends))]
    batch = build_batch(chunks, last_only=True, device=torch.device("cpu"))
    finals = dataclasses.replace(batch, rows=batch.rows[torch.tensor([1, 2])])
    per_layer, hoisted = engines
    assert len(hoisted.layer_runs(batch.tokens.shape[0])) == (3 if token_layers == 40 else 1)
    per_layer._write(finals, per_layer.family.prefill)
    want = per_layer._hashes(finals)
    got = hoisted._hoisted_forward(finals, hoisted.family.prefill, hashed=True)
    assert torch.equal(got, want)
    assert torch.equal(hoisted.pool.blocks, per_layer.pool.blocks)
    assert torch.equal(hoisted.pool.rings, per_layer.pool.rings)


def test_a_padded_prefill_graph_batch_writes_and_hashes_what_the_unpadded_batch_does():
    """What a prefill graph replays, run on the CPU: ``PrefillStepGraph.fill`` pads two chunks of 45 tokens to a
    bucket of 64 tokens and 4 requests (the padding tokens in the third request, positions -1, no blocks, no
    ring; the fourth empty), and the hoisted forward of that batch writes the bytes and gives the real rows the
    hashes of the per-layer forward of the unpadded chunks."""
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=2, kpool=4, num_spec=1, mla_entry_bytes=40)
    prompts = [[(3 * i + 2) % 1000 for i in range(n)] for n in (20, 300)]
    engines = []
    for _ in range(2):
        pool = CachePool(BlockLayout(config.cache), num_blocks=8, num_rings=2, device=torch.device("cpu"))
        engine = Engine(config, pool)
        engine.prefill([PrefillJob(prompt=prompts[1], block_ids=[2, 3], ring_id=1, end=275)])
        engines.append(engine)
    chunks = [(prompts[0], 0, [0, 1], 0), (prompts[1][275:], 275, [2, 3], 1)]
    graph = PrefillStepGraph(PrefillBucket(tokens=64, requests=4, table_width=4, hashed=True), torch.device("cpu"))
    graph.fill(chunks)
    padded = graph.batch()
    assert padded.query_start_loc.tolist() == [0, 20, 45, 64, 64]
    assert padded.positions[45:].tolist() == [-1] * 19 and padded.rows.tolist() == [19, 44, 63, 63]
    per_layer, hoisted = engines
    batch = build_batch(chunks, last_only=True, device=torch.device("cpu"))
    per_layer._write(batch, per_layer.family.prefill)
    want = per_layer._hashes(batch)
    got = hoisted._hoisted_forward(padded, hoisted.family.prefill, hashed=True)
    assert torch.equal(got[:2], want)
    assert torch.equal(hoisted.pool.blocks, per_layer.pool.blocks)
    assert torch.equal(hoisted.pool.rings, per_layer.pool.rings)


def test_prefill_token_buckets_are_powers_of_two_up_to_the_step():
    assert token_buckets(2048) == [256, 512, 1024, 2048]
    assert token_buckets(1000) == [256, 512, 1000]
    assert token_buckets(96) == [96]


def test_a_prefill_step_replays_the_smallest_bucket_that_holds_it_with_a_request_for_its_padding():
    def bucket(*sizes: int, blocks: int = 1) -> PrefillBucket | None:
        chunks = [([1] * n, 0, list(range(blocks)), 0) for n in sizes]
        return prefill_bucket(chunks, [256, 512, 1024, 2048], max_requests=4, block_size=256, min_width=2,
                              hashed=True)

    assert bucket(2048) == PrefillBucket(tokens=2048, requests=1, table_width=8, hashed=True)  # 8 blocks' positions
    assert bucket(100) == PrefillBucket(tokens=256, requests=2, table_width=2, hashed=True)  # + the padding request
    assert bucket(300, 200, 12) == PrefillBucket(tokens=512, requests=4, table_width=2, hashed=True)  # no padding
    assert bucket(300, 200, 13) == PrefillBucket(tokens=1024, requests=4, table_width=2, hashed=True)
    assert bucket(512, 512, 512, 512) == PrefillBucket(tokens=2048, requests=4, table_width=2, hashed=True)
    assert bucket(100, 100, 100, 100) is None  # the padding would be a fifth request
    assert bucket(2049) is None and bucket() is None
    assert bucket(10, blocks=5).table_width == 8


def test_no_collection_runs_while_a_capture_is_paused_and_the_collector_comes_back_as_it_was():
    import gc

    from kpool_pd.model.graph_capture import collection_paused
    was = gc.isenabled()
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            with collection_paused():
                assert not gc.isenabled()
            assert gc.isenabled() is before
        gc.enable()
        with pytest.raises(RuntimeError), collection_paused():
            raise RuntimeError("a failed capture")
        assert gc.isenabled(), "a failed capture left the collector off"
    finally:
        (gc.enable if was else gc.disable)()
