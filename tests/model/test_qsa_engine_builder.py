"""The QSA engine's metadata comes from its one ``QsaMetadataBuilder``: every forward's maps in the builder's
buffers (the same storage step after step, never fresh tensors), with the host split from the batch's host
copies; a forward larger than the buffers grows them once, and the bytes and tokens stay those of the builder-free
reference (``build_qsa_metadata`` of the same batch)."""

from __future__ import annotations

import torch

from kpool_pd.kernels.qsa_metadata import build_qsa_metadata
from kpool_pd.kvcache import BlockLayout, CacheFamily, CachePool
from kpool_pd.model import Engine, ModelConfig
from kpool_pd.model import qsa_family
from kpool_pd.model.engine import DecodeSequence, PrefillJob
from tests.support.allocations import placed

CONFIG = ModelConfig.build(family=CacheFamily.QSA, num_layers=2, compress_ratio=4, num_spec=3, block_size=64)
PROMPTS = [list(range(3, 40)), list(range(50, 63)), list(range(7, 30))]


def _run(monkeypatch=None) -> tuple[Engine, list[list[int]], list[str], list]:
    """Prefill three prompts and decode 6 tokens each; the metadata of every forward (copied) with its batch."""
    pool = CachePool(BlockLayout(CONFIG.cache), num_blocks=12, num_rings=3)
    engine = Engine(CONFIG, pool)
    seen = []
    real = engine.family._metadata_of

    def spy(batch):
        metadata = real(batch)
        if not seen or seen[-1][0] is not batch:
            seen.append((batch, metadata, {name: getattr(metadata, name).clone() for name in
                                           ("token_to_req", "ring_slot_mapping", "compressed_slot_mapping")}))
        return metadata

    engine.family._metadata_of = spy
    blocks = [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3] for i in range(3)]
    firsts = engine.prefill([PrefillJob(prompt=p, block_ids=b, ring_id=i) for i, (p, b) in enumerate(zip(PROMPTS, blocks))])
    sequences = [DecodeSequence(request_id=f"r{i}", prompt_len=len(p), max_tokens=6, allocation=placed(engine.pool, blocks[i], i),
                                output=[firsts[i]]) for i, p in enumerate(PROMPTS)]
    while not all(s.finished for s in sequences):
        engine.decode_step(sequences)
    digests = [engine.state_digest(blocks[i], i, s.cached) for i, s in enumerate(sequences)]
    return engine, [s.output for s in sequences], digests, seen


def test_every_forward_builds_its_metadata_in_the_one_builders_buffers():
    engine, _, _, seen = _run()
    builder = engine.family.builder
    assert len(seen) >= 3  # the prefill and the decode steps
    buffers = {name: buffer.data_ptr() for name, buffer in builder.buffers.items()}
    for batch, metadata, maps in seen:
        assert metadata.token_to_req.data_ptr() == buffers["token_to_req"]
        assert metadata.ring_slot_mapping.data_ptr() == buffers["ring_slot_mapping"]
        assert metadata.split is not None and metadata.split.num_actual_tokens == batch.tokens.shape[0]
        fresh = build_qsa_metadata(batch.query_start_loc, batch.seq_lens, batch.block_table, batch.ring_ids,
                                   compress_ratio=4, ring_capacity=CONFIG.cache.ring_slots, block_size=64)
        for name, value in maps.items():
            assert torch.equal(value, getattr(fresh, name)), name
    first_step = seen[1][1].split  # every request: its last token and 3 drafts, one uniform decode block
    assert (first_step.num_decodes, first_step.decode_query_len, first_step.num_prefills) == (3, 4, 0)
    assert engine.family.builder is builder


def test_a_forward_larger_than_the_buffers_grows_them_once_and_writes_the_same_bytes(monkeypatch):
    _, outputs, digests, _ = _run()
    monkeypatch.setattr(qsa_family, "BUILDER_TOKENS", 16)
    monkeypatch.setattr(qsa_family, "BUILDER_REQUESTS", 2)
    engine, small_outputs, small_digests, seen = _run()
    assert engine.family.builder.max_num_batched_tokens == 2 * sum(map(len, PROMPTS))  # grown by the prefill
    assert engine.family.builder.max_num_seqs == 6
    assert (small_outputs, small_digests) == (outputs, digests)
