"""The state digest reads every layer's bytes of a request at once (``kpool_pd.model.cache_io.layer_stack``): the same
bytes, in the same order, as reading them layer by layer through each layer's own views."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kpool_pd.kernels import kpool_read_entries
from kpool_pd.kernels.kpool_cache import pool_slots
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheDtype, CacheFamily, CachePool
from kpool_pd.model import DecodeSequence, Engine, ModelConfig, PrefillJob
from kpool_pd.model.cache_io import layer_ring_rows, layer_stack, open_positions, read_ring_rows
from tests.support.allocations import placed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _per_layer_digest(engine: Engine, block_ids: list[int], ring_id: int, length: int) -> str:
    """The digest's definition, read one layer at a time through the pool's per-layer views."""
    pool, cache, layers = engine.pool, engine.pool.config, range(engine.config.num_layers)
    device = pool.device
    parts = []
    complete = cache.complete_entries(length)
    for layer in layers:
        if cache.family is CacheFamily.KPOOL:
            spec = cache.family_spec
            slots = pool_slots(torch.tensor([block_ids], device=device), torch.arange(complete, device=device)[None], kpool=spec.tokens_per_entry,
                               states=spec.entries_per_block)[0]
            q, scale = kpool_read_entries(pool.indexer_q(layer), pool.indexer_scale(layer), slots, dequantize=False)
            parts.append(torch.cat([q.view(torch.uint8), scale.view(torch.uint8).view(-1, 4)], dim=1).reshape(-1))
        else:
            keys = cache.family_spec.keys
            groups = torch.arange(complete, device=device)
            blocks = torch.tensor(block_ids, device=device)[groups * keys.compress_ratio // cache.block_size]
            rows = pool.qsa_keys(layer)[blocks, groups % keys.rows_per_block]
            parts.append(rows.contiguous().view(torch.uint8).reshape(-1))
    open_pos = open_positions(cache, torch.tensor([length], device=device))[:, : length - cache.open_entry_start(length)]
    parts += [read_ring_rows(pool, layer, torch.tensor([ring_id], device=device), open_pos).reshape(-1) for layer in layers]
    positions = torch.arange(length, device=device)
    blocks = torch.tensor(block_ids, device=device)[positions // cache.block_size]
    parts += [pool.mla(layer)[blocks, positions % cache.block_size].reshape(-1) for layer in layers]
    return hashlib.sha256(torch.cat(parts).cpu().numpy()).hexdigest()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """# [..., n] of any dtype -> [..., n * itemsize] uint8 (compared bytewise: NaN payloads included)"""
    return tensor.contiguous().view(torch.uint8)


CONFIGS = [
    pytest.param(dict(family=CacheFamily.KPOOL, kpool=4, num_layers=3), id="kpool4"),
    pytest.param(dict(family=CacheFamily.KPOOL, kpool=4, num_layers=3, kernel_page_states=32), id="kpool4-pages32"),
    pytest.param(dict(family=CacheFamily.KPOOL, kpool=2, num_layers=2, block_order=BlockOrder.BLHNC), id="kpool2-hnc"),
    pytest.param(dict(family=CacheFamily.KPOOL, kpool=8, num_layers=1), id="kpool8-one-layer"),
    pytest.param(dict(family=CacheFamily.QSA, compress_ratio=4, num_layers=3), id="qsa4"),
    pytest.param(dict(family=CacheFamily.QSA, compress_ratio=4, num_layers=2, qsa_dtype=CacheDtype.FP8,
                      block_order=BlockOrder.BLHNC), id="qsa4-fp8-hnc"),
]


@pytest.mark.parametrize("options", CONFIGS)
@pytest.mark.parametrize("prompt_len,max_tokens", [(301, 6), (256, 5), (7, 2)])
def test_state_digest_equals_the_per_layer_reads(options, prompt_len, max_tokens):
    check_state_digest(ModelConfig.build(num_spec=2, **options), prompt_len, max_tokens, "cpu")


def check_state_digest(config: ModelConfig, prompt_len: int, max_tokens: int, device: str) -> None:
    """A request prefilled and decoded to its end on ``device``: its digest is the per-layer reads', and one
    flipped byte of the last layer changes it."""
    pool = CachePool(BlockLayout(config.cache), num_blocks=12, num_rings=3, device=device)
    engine = Engine(config, pool)
    prompt = [(7 * t + 3) % config.vocab_size for t in range(prompt_len)]
    blocks = config.cache.blocks_for_request(prompt_len, max_tokens)
    block_ids = [11 - 2 * i for i in range(blocks)]  # neither in order nor contiguous
    first = engine.prefill([PrefillJob(prompt=prompt, block_ids=block_ids, ring_id=2)])[0]
    seq = DecodeSequence(request_id="r", prompt_len=prompt_len, max_tokens=max_tokens, allocation=placed(engine.pool, block_ids, 2),
                         output=[first])
    while not seq.finished:
        engine.decode_step([seq])
    expected = _per_layer_digest(engine, block_ids, 2, seq.cached)
    assert engine.state_digest(block_ids, 2, seq.cached) == expected
    pool.mla(config.num_layers - 1)[block_ids[0], 0, 0, 0] ^= 1  # the last layer's first MLA byte
    assert engine.state_digest(block_ids, 2, seq.cached) != expected


@pytest.mark.parametrize("options", CONFIGS)
def test_layer_stack_is_the_layers_views_without_a_copy(options):
    config = ModelConfig.build(**options)
    pool = CachePool(BlockLayout(config.cache), num_blocks=3, num_rings=2)
    pool.blocks.copy_(torch.randint(0, 256, pool.blocks.shape, dtype=torch.uint8))
    pool.rings.copy_(torch.randint(0, 256, pool.rings.shape, dtype=torch.uint8))
    layers = range(config.num_layers)
    fields = [pool.mla, lambda layer: layer_ring_rows(pool, layer)]
    fields += ([pool.indexer_q, pool.indexer_scale] if config.cache.family is CacheFamily.KPOOL else [pool.qsa_keys])
    for view_of in fields:
        views = [view_of(layer) for layer in layers]
        stacked = layer_stack(views)
        assert stacked.dtype == views[0].dtype
        assert stacked.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()  # a view
        assert torch.equal(_bytes(stacked), _bytes(torch.stack(views)))


def test_layer_stack_refuses_views_that_do_not_step_evenly():
    base = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="layer 2's view"):
        layer_stack([base[0:10], base[10:20], base[25:35]])
    with pytest.raises(ValueError, match="layer 1's view"):
        layer_stack([base[0:10], base[10:19]])
    with pytest.raises(ValueError, match="layer 1's view"):
        layer_stack([base[0:10], torch.zeros(10, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="at least one"):
        layer_stack([])
    assert torch.equal(layer_stack([base[0:10], base[10:20], base[20:30]]), base[:30].view(3, 10))
