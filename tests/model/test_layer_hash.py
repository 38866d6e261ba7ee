"""The fused layer hash (``kpool_pd.model.layer_hash``) against its torch reference, each body once, on every backend
that runs kernels: Triton's CPU interpreter here, compiled on CUDA through tests/gpu/test_layer_hash_gpu.py
(tests/support/kernel_backends.py).

The caches are real: an engine prefills prompts whose lengths lie at and around pool (group) and block
boundaries, then runs decode steps with drafts; the selections are the family's own top-k (more pools than
some rows have complete, so some are -1), and two padding rows (no tokens, no blocks, no ring) ride along.
Integer arithmetic is exact, so the rule is equality, bit for bit, for every row and every layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

from kpool_pd.kernels.dispatch import FORCE_TRITON_ENV
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheDtype, CacheFamily, CachePool
from kpool_pd.model import DecodeSequence, Engine, ModelConfig, PrefillJob
from kpool_pd.model.batch import ForwardBatch, build_batch
from kpool_pd.model.layer_hash import kpool_layer_hash, qsa_layer_hash, ref
from kpool_pd.model.rule import HASH_PRIME, LAYER_MULTIPLIER
from tests.support.kernel_backends import KERNEL_BACKENDS, Backend, make_backend
from tests.support.allocations import placed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PADDING_ROWS = 2

KPOOL, QSA = CacheFamily.KPOOL, CacheFamily.QSA
# (ModelConfig.build options, two heads in the MLA and QSA key pages, prompt lengths)
CASES = [
    pytest.param(dict(family=KPOOL, kpool=2, num_spec=0, block_size=128), False, [1, 2, 3, 16, 17, 129, 130],
                 id="kpool2-spec0-block128"),
    pytest.param(dict(family=KPOOL, kpool=4, num_spec=3, block_order=BlockOrder.BLHNC, kernel_page_states=32), False,
                 [3, 4, 5, 12, 13, 38], id="kpool4-spec3-blhnc-pages32"),
    pytest.param(dict(family=KPOOL, kpool=4, num_spec=3, block_size=128, kernel_page_states=64,
                      mla_entry_bytes=656), False, [7, 8, 9, 125, 126], id="kpool4-spec3-block128-mla656"),
    pytest.param(dict(family=KPOOL, kpool=2, num_spec=3, block_size=128), True, [2, 5, 127], id="kpool2-spec3-heads2"),
    pytest.param(dict(family=QSA, compress_ratio=4, num_spec=0, block_size=128), False, [1, 3, 4, 5, 32, 33, 131],
                 id="qsa4-spec0-bf16-block128"),
    pytest.param(dict(family=QSA, compress_ratio=4, num_spec=3, qsa_dtype=CacheDtype.FP8_E4M3,
                      block_order=BlockOrder.BLHNC), False, [4, 7, 8, 9, 40], id="qsa4-spec3-fp8-blhnc"),
    pytest.param(dict(family=QSA, compress_ratio=2, num_spec=3, qsa_dtype=CacheDtype.BFLOAT16), True, [1, 2, 3, 19],
                 id="qsa2-spec3-bf16-heads2"),
]


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


@contextlib.contextmanager
def references_only():
    """Build the caches with the ops' torch references on CPU (the interpreter would take minutes); on CUDA
    the ops run their kernels either way."""
    forced = os.environ.pop(FORCE_TRITON_ENV, None)
    try:
        yield
    finally:
        if forced is not None:
            os.environ[FORCE_TRITON_ENV] = forced


def with_padding(batch: ForwardBatch, count: int) -> ForwardBatch:
    """``batch`` and ``count`` more requests of one padding row each: position -1 (no visible token), no blocks,
    ring id -1, as a fixed-size (CUDA graph) batch pads."""
    device, tokens = batch.tokens.device, batch.tokens.shape[0]
    extra = torch.arange(1, count + 1, device=device)

    def more(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((count, *t.shape[1:]), value, dtype=t.dtype, device=device)])

    return dataclasses.replace(
        batch, tokens=more(batch.tokens, 0), positions=more(batch.positions, -1),
        query_start_loc=torch.cat([batch.query_start_loc, (batch.query_start_loc[-1] + extra).to(torch.int32)]),
        start_pos=more(batch.start_pos, 0), seq_lens=more(batch.seq_lens, 0), block_table=more(batch.block_table, -1),
        ring_ids=more(batch.ring_ids, -1), rows=torch.cat([batch.rows, tokens + extra - 1]), from_zero=False)


def build_engine(options: dict, two_heads: bool, prompt_lens: list[int], device: torch.device, layers: int = 2):
    """An engine over a fresh pool that prefilled one prompt of each length (blocks and rings not in order)
    and ran one decode step; returns it and the sequences."""
    config = ModelConfig.build(num_layers=layers, topk=8, mla_entry_bytes=options.pop("mla_entry_bytes", 24),
                               **options)
    if two_heads:
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, mla_num_heads=2,
                                                                       qsa_num_heads=2))
    cache = config.cache
    blocks_each = [cache.blocks_for_tokens(n + 8) for n in prompt_lens]
    order = torch.randperm(sum(blocks_each), generator=torch.Generator().manual_seed(len(prompt_lens))).tolist()
    pool = CachePool(BlockLayout(cache), num_blocks=sum(blocks_each), num_rings=len(prompt_lens) + 1, device=device)
    engine = Engine(config, pool)
    gen = torch.Generator().manual_seed(sum(prompt_lens))
    jobs, start = [], 0
    for i, (n, count) in enumerate(zip(prompt_lens, blocks_each)):
        prompt = torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
        jobs.append(PrefillJob(prompt=prompt, block_ids=order[start:start + count], ring_id=len(prompt_lens) - i))
        start += count
    firsts = engine.prefill(jobs)
    sequences = [DecodeSequence(request_id=f"r{i}", prompt_len=len(j.prompt), max_tokens=8, allocation=placed(engine.pool, j.block_ids, j.ring_id),
                                output=[t]) for i, (j, t) in enumerate(zip(jobs, firsts))]
    engine.decode_step(sequences)
    return engine, sequences


def batches(engine: Engine, sequences: list[DecodeSequence]) -> list[ForwardBatch]:
    """Two forwards over the engine's cache: each request's last cached token (seq_len = its committed length),
    and the next decode step (its pending token and drafts, written into the cache first), both padded."""
    device = engine.device
    last = build_batch([([0], s.cached - 1, s.block_ids, s.ring_id) for s in sequences], last_only=True, device=device)
    step = build_batch([([s.pending, *engine.rule.drafts(s.pending, engine.config.cache.num_spec)], s.cached,
                         s.block_ids, s.ring_id) for s in sequences], last_only=False, device=device)
    engine._write(step, engine.family.decode)
    return [with_padding(last, PADDING_ROWS), with_padding(step, PADDING_ROWS)]


def layer_hashes(engine: Engine, batch: ForwardBatch, layer: int, acc: torch.Tensor):
    """(the dispatching op's new hash, the reference's, the selection) of one layer."""
    family = engine.family
    with references_only():
        selection = family.select(layer, batch)
    args = (acc, engine.rule.hash_weights[layer], *selection, *family.layer_views(layer))
    if engine.config.cache.family is KPOOL:
        kw = dict(kpool=family.kpool)
        return kpool_layer_hash(*args, **kw), ref.kpool_layer_hash(*args, **kw), selection
    kw = dict(compress_ratio=family.ratio)
    return qsa_layer_hash(*args, **kw), ref.qsa_layer_hash(*args, **kw), selection


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("options,two_heads,prompt_lens", CASES)
def test_fused_hash_equals_reference(backend, options, two_heads, prompt_lens):
    with references_only():
        engine, sequences = build_engine(dict(options), two_heads, prompt_lens, backend.device)
        forwards = batches(engine, sequences)
    gen = torch.Generator().manual_seed(7)
    some_none = False
    for batch in forwards:
        rows = batch.rows.shape[0]
        for layer in range(engine.config.num_layers):
            acc = torch.randint(0, HASH_PRIME, (rows,), generator=gen, dtype=torch.int64).to(backend.device)
            got, want, selection = layer_hashes(engine, batch, layer, acc)
            assert torch.equal(got.cpu(), want.cpu()), f"layer {layer}: rows {torch.nonzero(got != want).flatten()}"
            some_none |= bool((selection[0][:-PADDING_ROWS] < 0).any())
            padded = acc[-PADDING_ROWS:] * LAYER_MULTIPLIER % HASH_PRIME
            assert torch.equal(got[-PADDING_ROWS:], padded), "a padding row hashes nothing but the chain"
    assert some_none, "no row selected fewer pools than topk: the -1 paths were not tested"


@pytest.mark.parametrize("family", [pytest.param(KPOOL, id="kpool"), pytest.param(QSA, id="qsa")])
def test_padding_rows_have_all_zero_features(family):
    """The torch path itself: a padding row's features are all zero (so its hash is the chain's step alone)."""
    engine, sequences = build_engine(dict(family=family, num_spec=3), False, [5, 9], torch.device("cpu"), layers=1)
    for batch in batches(engine, sequences):
        features = engine.family.features(0, batch)
        assert features.shape[1] == engine.family.feature_width
        assert not bool(features[-PADDING_ROWS:].any())
        assert bool(features[:-PADDING_ROWS].any())


def test_engine_tokens_come_from_the_family_chain():
    """Engine._hashes folds each layer through ``family.chain``: the same hashes as the rule over the features."""
    engine, sequences = build_engine(dict(family=KPOOL, kpool=4, num_spec=3), False, [6, 13], torch.device("cpu"))
    batch = batches(engine, sequences)[1]
    acc = engine.rule.start(batch.rows.shape[0], engine.device)
    for layer in range(engine.config.num_layers):
        acc = engine.rule.chain(acc, layer, engine.family.features(layer, batch))
    assert torch.equal(engine._hashes(batch), acc)


def test_bad_arguments_name_their_values():
    engine, sequences = build_engine(dict(family=KPOOL, kpool=2, num_spec=0), False, [5], torch.device("cpu"),
                                     layers=1)
    batch = batches(engine, sequences)[0]
    family, weights = engine.family, engine.rule.hash_weights[0]
    pools, seq_lens, table, ring_ids = family.select(0, batch)
    views = family.layer_views(0)
    acc = torch.zeros(pools.shape[0], dtype=torch.int64)
    with pytest.raises(ValueError, match="features of these arguments are"):
        kpool_layer_hash(acc, weights[:-1], pools, seq_lens, table, ring_ids, *views, kpool=2)
    with pytest.raises(ValueError, match="every per-row argument"):
        kpool_layer_hash(acc[:-1], weights, pools, seq_lens, table, ring_ids, *views, kpool=2)
    with pytest.raises(ValueError, match="kpool must be an integer >= 2, got 1"):
        kpool_layer_hash(acc, weights, pools, seq_lens, table, ring_ids, *views, kpool=1)
    with pytest.raises(ValueError, match="hold 512 tokens, MLA blocks 256"):
        kpool_layer_hash(acc, weights, pools, seq_lens, table, ring_ids, *views, kpool=4)
    with pytest.raises(ValueError, match="acc must be torch.int64"):
        kpool_layer_hash(acc.to(torch.int32), weights, pools, seq_lens, table, ring_ids, *views, kpool=2)
