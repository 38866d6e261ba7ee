"""QSA decode steps replayed from CUDA graphs (model.decode_graphs, RequestPadding.EMPTY) equal eager steps byte for
byte, as tests/gpu/test_decode_graphs_gpu.py checks for kpool.

Continuous batching over text and image prompts (MRoPE positions that differ by axis, kept in the ring) of several
lengths makes the batch grow and shrink through the buckets (1, 2, 4, 8 requests), the block tables widen, and
requests near their end bring fewer real drafts than num_spec. Every request's tokens, output digest, state digest and
accepted drafts must equal the eager run's. A graphed step builds its metadata inside the graph in the engine's one
QsaMetadataBuilder (the same buffers step after step) and synchronises with the host once.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from kpool_pd.kvcache import BlockLayout, CacheFamily, NodeCache
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import run_colocated
from kpool_pd.model.engine import DecodeSequence, Engine, PrefillJob
from kpool_pd.model.prompt import mrope_delta
from tests.support.mrope_prompts import image_prompt_positions, image_requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = [(7, None, 40), (300, (5, 8, 12), 3), (64, (0, 4, 4), 17), (1000, (100, 16, 20), 64), (129, None, 1),
          (2, None, 25), (515, (40, 10, 10), 40), (33, (1, 2, 2), 3), (256, (64, 8, 8), 17), (90, None, 64),
          (411, (3, 12, 9), 25), (48, (6, 3, 5), 1), (700, (200, 20, 14), 40)]


def config(*, num_spec: int, ratio: int) -> ModelConfig:
    return ModelConfig.build(family=CacheFamily.QSA, num_layers=4, compress_ratio=ratio, num_spec=num_spec,
                             cache_rope_positions=True)


@pytest.mark.parametrize("num_spec", [0, 3])
@pytest.mark.parametrize("ratio", [1, 4])
def test_graphed_qsa_decode_equals_eager(num_spec, ratio):
    cfg = config(num_spec=num_spec, ratio=ratio)
    work = image_requests(SHAPES, vocab_size=cfg.vocab_size)
    eager = run_colocated(cfg, work, max_batch=8, device="cuda")
    graphed = run_colocated(cfg, work, max_batch=8, device="cuda", graph_requests=8)
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]
    assert [r.output_digest for r in graphed] == [r.output_digest for r in eager]
    assert [r.state_digest for r in graphed] == [r.state_digest for r in eager]
    assert [r.drafts_accepted for r in graphed] == [r.drafts_accepted for r in eager]


def test_a_graphed_qsa_step_synchronises_once_in_the_builders_buffers():
    """After ``capture_graphs`` (every request bucket at the daemon's table width), steps only replay: one host
    synchronisation a step, no new capture, and the builder (its buffers, which the graphs write) unchanged."""
    cfg = config(num_spec=3, ratio=4)
    cache = NodeCache(BlockLayout(cfg.cache), num_blocks=64, num_rings=4, device="cuda")
    engine = Engine(cfg, cache.pool, graph_requests=4, graph_table_width=3)
    builder = engine.family.builder
    addresses = {name: buffer.data_ptr() for name, buffer in builder.buffers.items()}
    engine.capture_graphs()
    captured = set(engine.graphs._graphs)
    assert {(b.requests, b.table_width) for b in captured} == {(1, 4), (2, 4), (4, 4)}
    seqs = []
    for i, prompt_len in enumerate((100, 257, 31)):
        allocation = cache.allocate(f"r{i}", cfg.cache.blocks_for_request(prompt_len, 50))
        prompt = [(7 * i + j) % cfg.vocab_size for j in range(prompt_len)]
        positions = image_prompt_positions(prompt_len, 2, 4, 5)
        first = engine.prefill([PrefillJob(prompt=prompt, block_ids=allocation.block_ids, ring_id=allocation.ring_id,
                                           mrope_positions=positions)])[0]
        seqs.append(DecodeSequence(request_id=f"r{i}", prompt_len=prompt_len, max_tokens=50, allocation=allocation,
                                   output=[first], mrope_delta=mrope_delta(positions, prompt_len)))
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
        for seq in seqs:
            seq.allocation.release()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 3, [str(w.message) for w in syncs]
    assert set(engine.graphs._graphs) == captured  # no step captured anew
    assert engine.family.builder is builder
    assert {name: buffer.data_ptr() for name, buffer in builder.buffers.items()} == addresses
    assert all(len(s.output) > 4 for s in seqs)


def test_a_graphed_qsa_step_writes_what_an_eager_step_writes_with_every_draft_real():
    """Where every request brings num_spec real drafts, a graphed step and an eager step write the same bytes, every
    block and ring, step after step (padding requests of no token write nothing)."""
    cfg = config(num_spec=3, ratio=4)
    engines, runs = [], []
    for graphs in (0, 4):
        cache = NodeCache(BlockLayout(cfg.cache), num_blocks=32, num_rings=3, device="cuda")
        engine = Engine(cfg, cache.pool, graph_requests=graphs)
        seqs = []
        for i, prompt_len in enumerate((61, 130, 9)):
            allocation = cache.allocate(f"r{i}", cfg.cache.blocks_for_request(prompt_len, 200))
            prompt = [(5 * i + 3 * j) % cfg.vocab_size for j in range(prompt_len)]
            positions = image_prompt_positions(prompt_len, 1, 2, 4)
            first = engine.prefill([PrefillJob(prompt=prompt, block_ids=allocation.block_ids,
                                               ring_id=allocation.ring_id, mrope_positions=positions)])[0]
            seqs.append(DecodeSequence(request_id=f"r{i}", prompt_len=prompt_len, max_tokens=200, allocation=allocation,
                                       output=[first], mrope_delta=mrope_delta(positions, prompt_len)))
        engines.append(engine)
        runs.append(seqs)
    eager, graphed = engines
    try:
        for step in range(6):  # 3 requests: the bucket of 4 holds one empty padding request
            assert graphed.decode_step(runs[1]) == eager.decode_step(runs[0]), f"step {step}"
            assert torch.equal(graphed.pool.blocks, eager.pool.blocks), f"step {step}: blocks differ"
            assert torch.equal(graphed.pool.rings, eager.pool.rings), f"step {step}: rings differ"
    finally:
        for seqs in runs:
            for seq in seqs:
                seq.allocation.release()


def test_prefill_graphs_refuse_qsa():
    cfg = config(num_spec=0, ratio=4)
    cache = NodeCache(BlockLayout(cfg.cache), num_blocks=8, num_rings=2, device="cuda")
    with pytest.raises(ValueError, match="prefill graphs serve kpool pools on CUDA; this engine's pool is qsa on cuda"):
        Engine(cfg, cache.pool, prefill_graph_tokens=64)


def test_qsa_daemons_on_the_gpu_with_image_prompts_equal_colocated(tmp_path):
    """A prefill and a decode daemon on the GPU (the decode daemon replays its steps from CUDA graphs, captured at
    start), image prompts with their MRoPE positions on the Generate API: every request equals the colocated run."""
    import asyncio
    import signal

    from kpool_pd.decode_worker.client import RequestFailed, generate_all
    from kpool_pd.runtime import model_flags, model_settings
    from kpool_pd.runtime.launch import start_decode, start_prefill

    cfg = ModelConfig.build(family=CacheFamily.QSA, num_layers=2, compress_ratio=4, num_spec=3, seed=11,
                            cache_rope_positions=True)
    flags = model_flags(model_settings(cfg))
    decode_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    requests = image_requests(SHAPES[:10], vocab_size=cfg.vocab_size, seed=5)
    reference = {r.request_id: r for r in run_colocated(cfg, requests, device="cuda:0")}
    prefill = start_prefill(tmp_path, flags, extra=["--device", "cuda:0", "--num-blocks", "512", "--log-format", "text",
                                                    "--max-batch-tokens", "256"])
    decode = None
    try:
        prefill.wait_ready(240)
        decode = start_decode(tmp_path, flags, [f"127.0.0.1:{prefill.port}"], name="decode", transport="grpc",
                              extra=["--device", decode_device, "--log-format", "text", "--max-running", "8",
                                     "--max-prompt-tokens", "1024"])
        decode.wait_ready(240)
        results = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", requests))
        failed = [r for r in results if isinstance(r, RequestFailed)]
        assert not failed, f"{len(failed)} failed: {failed[0]}\n{decode.log_tail()}"
        for r in results:
            want = reference[r.request_id]
            assert (r.tokens, r.output_digest, r.state_digest) == (want.tokens, want.output_digest, want.state_digest), \
                r.request_id
    finally:
        for d in (decode, prefill):
            if d is not None:
                d.signal(signal.SIGTERM)
        for d in (decode, prefill):
            if d is not None:
                d.stop()
