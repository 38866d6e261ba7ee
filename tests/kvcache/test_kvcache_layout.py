"""Unified block layout: typed views alias the pool's bytes; the layout hash covers every field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kpool_pd.kvcache import (
    BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool, FieldKind, PoolMode, layout_hash,
)
from kpool_pd.kvcache.layout import layout_differences

KPOOL = CacheConfig(layer_names=("l0", "l1", "l2"), block_size=64, kpool=4, num_spec=3)
QSA = CacheConfig(family=CacheFamily.QSA, layer_names=("l0", "l1"), block_size=64, compress_ratio=4, num_spec=3,
                  qsa_num_heads=2, cache_rope_positions=True)


def _pool(config: CacheConfig) -> CachePool:
    return CachePool(BlockLayout(config), num_blocks=5, num_rings=3)


def _expected_block_bytes(config: CacheConfig) -> int:
    align = lambda n: -(-n // 16) * 16  # noqa: E731
    return config.num_layers * (align(config.mla.page_bytes) + align(config.indexer_page_bytes))


@pytest.mark.parametrize("config", [KPOOL, QSA], ids=["kpool", "qsa"])
def test_block_is_every_layer_back_to_back(config):
    layout = BlockLayout(config)
    assert layout.block_bytes == _expected_block_bytes(config)
    assert layout.ring_block_bytes == layout.ring_slots * layout.ring_slot_bytes
    assert layout.ring_slot_bytes == config.num_layers * config.ring_row_bytes


@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda o: o.value)
def test_views_alias_the_pool_bytes(order):
    pool = _pool(dataclasses.replace(KPOOL, order=order))
    for layer in range(3):
        for view in (pool.mla(layer), pool.indexer_q(layer), pool.indexer_scale(layer), pool.tail_ring(layer)):
            assert view.untyped_storage().data_ptr() == pool.blocks.untyped_storage().data_ptr() or \
                view.untyped_storage().data_ptr() == pool.rings.untyped_storage().data_ptr()
    pool.indexer_scale("l1")[3, 0, 5] = 2.0
    layout = pool.layout
    offset = layout.layer("l1").indexer_offset + 16 * 128 + 5 * 4
    assert pool.blocks[3, offset:offset + 4].view(torch.float32).item() == 2.0
    pool.indexer_q(2)[4, 0, 15, 127] = 1.0
    offset = layout.layer(2).indexer_offset + 15 * 128 + 127
    assert pool.blocks[4, offset].item() == 0x38  # 1.0 in e4m3


def test_mla_orders_place_heads_differently():
    config = dataclasses.replace(KPOOL, mla_num_heads=2, mla_entry_bytes=8)
    for order, (token, head) in ((BlockOrder.BLNHC, (1, 0)), (BlockOrder.BLHNC, (0, 1))):
        pool = _pool(dataclasses.replace(config, order=order))
        view = pool.mla(0)
        assert view.shape == (5, 64, 2, 8)
        view[0, token, head, 0] = 7
        expected_offset = 2 * 8 if order is BlockOrder.BLNHC else 64 * 8
        assert pool.blocks[0, expected_offset].item() == 7


def test_ring_is_slot_major_across_layers():
    pool = _pool(KPOOL)
    layout = pool.layout
    pool.tail_ring(2)[1, 1, 5, 3] = 1.5  # ring 1, gate half, slot 5, dim 3
    offset = 5 * layout.ring_slot_bytes + 2 * layout.ring_row_bytes + 128 * 2 + 3 * 2
    assert pool.rings[1, offset:offset + 2].view(torch.bfloat16).item() == 1.5


@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda o: o.value)
@pytest.mark.parametrize("dtype", [CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3], ids=lambda d: d.value)
def test_qsa_views(order, dtype):
    pool = _pool(dataclasses.replace(QSA, order=order, qsa_dtype=dtype))
    keys = pool.qsa_keys(1)
    assert keys.shape == (5, 16, 2, 128) and keys.dtype == dtype.torch_dtype
    keys[2, 3, 1, 4] = 1.0
    size = dtype.torch_dtype.itemsize
    row = (3 * 2 + 1) if order is BlockOrder.BLNHC else (1 * 16 + 3)
    offset = pool.layout.layer(1).indexer_offset + (row * 128 + 4) * size
    assert pool.blocks[2, offset:offset + size].view(dtype.torch_dtype).item() == 1.0
    ring = pool.qsa_ring(0)
    assert ring.shape == (3, 8, 2, 140)
    ring[0, 7, 1, 128:140].view(torch.int64)[:] = torch.tensor([2**40, 5, -1])
    assert ring[0, 7, 1, 128:140].view(torch.int64).tolist() == [2**40, 5, -1]


@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda o: o.value)
def test_field_offsets_are_the_bytes_written_by_hand(order):
    # kpool 2 in 128-token blocks: 64 states in two kernel pages of 32; MLA of 2 heads x 48 bytes
    config = CacheConfig(layer_names=("l0", "l1"), block_size=128, kpool=2, kernel_page_states=32, order=order,
                         mla_num_heads=2, mla_entry_bytes=48)
    layout = BlockLayout(config)
    assert [f.kind for f in layout.fields] == [FieldKind.MLA, FieldKind.KPOOL_ENTRY, FieldKind.KPOOL_SCALE]
    l1 = layout.layer(1)
    mla = layout.field(FieldKind.MLA)
    head_1_of_token_5 = 5 * 2 * 48 + 48 if order is BlockOrder.BLNHC else 128 * 48 + 5 * 48
    assert mla.offset(layer=1, row=5, head=1) == l1.mla_offset + head_1_of_token_5
    page_bytes = 32 * (128 + 4)
    assert layout.field(FieldKind.KPOOL_ENTRY).offset(layer=1, row=33, head=0) == l1.indexer_offset + page_bytes + 128
    assert layout.field(FieldKind.KPOOL_SCALE).offset(layer=1, row=33, head=0) == (
        l1.indexer_offset + page_bytes + 32 * 128 + 4)
    blocks = torch.zeros(3, layout.block_bytes, dtype=torch.uint8)
    layout.field(FieldKind.KPOOL_SCALE).view(blocks, 1)[2, 1, 1, 0] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    at = l1.indexer_offset + page_bytes + 32 * 128 + 4
    assert blocks[2, at:at + 4].tolist() == [1, 2, 3, 4] and int(blocks.sum()) == 10
    with pytest.raises(ValueError, match="a kpool block holds no qsa_keys field"):
        layout.field(FieldKind.QSA_KEYS)


def test_family_views_are_refused_across_families():
    with pytest.raises(ValueError, match="kpool family"):
        _pool(QSA).tail_ring(0)
    with pytest.raises(ValueError, match="qsa family"):
        _pool(KPOOL).qsa_keys(0)


def test_unknown_layer_is_named():
    with pytest.raises(KeyError, match="'l9'"):
        BlockLayout(KPOOL).layer("l9")


_CHANGES = {
    "layer_names": ("l0", "l1", "lx"), "block_size": 128, "num_spec": 1, "mla_entry_bytes": 600, "mla_num_heads": 2,
    "order": BlockOrder.BLHNC, "kpool": 2, "pool_mode": PoolMode.KEEP_LAST, "round_scale": False,
    "compress_ratio": 8, "qsa_head_size": 64, "qsa_num_heads": 1, "qsa_dtype": CacheDtype.FP8_E4M3,
    "cache_rope_positions": True, "format_version": 2, "family": CacheFamily.QSA, "kernel_page_states": 32,
}
_KPOOL_ONLY = {"kpool", "pool_mode", "round_scale", "kernel_page_states"}
_QSA_ONLY = {"compress_ratio", "qsa_head_size", "qsa_num_heads", "qsa_dtype", "cache_rope_positions"}


def test_every_field_is_listed():
    assert set(_CHANGES) == {f.name for f in dataclasses.fields(CacheConfig)}


@pytest.mark.parametrize("field", sorted(_CHANGES))
def test_layout_hash_changes_with_every_field(field):
    for base, ignored in ((KPOOL, _QSA_ONLY), (QSA, _KPOOL_ONLY)):
        value = _CHANGES[field]
        if field == "family":
            value = CacheFamily.KPOOL if base.family is CacheFamily.QSA else CacheFamily.QSA
        if field == "cache_rope_positions":
            value = not base.cache_rope_positions
        if field == "kernel_page_states":
            base = dataclasses.replace(base, block_size=256)  # S = 64: one page of 64, or two of 32
        changed = dataclasses.replace(base, **{field: value})
        if field in ignored:
            assert layout_hash(changed) == layout_hash(base), f"{field} does not change {base.family.value} bytes"
        else:
            assert layout_hash(changed) != layout_hash(base), field
            assert layout_differences(BlockLayout(base).describe(), BlockLayout(changed).describe())


def test_differences_name_the_fields():
    ours = BlockLayout(KPOOL).describe()
    theirs = BlockLayout(dataclasses.replace(KPOOL, kpool=2, block_size=32)).describe()
    assert {"kpool", "block_size", "layout_hash"} <= set(layout_differences(ours, theirs))


def test_kernel_page_states_change_the_hash_only_where_they_change_bytes():
    one_page = dataclasses.replace(KPOOL, kernel_page_states=32)  # S = 16 <= 32: one page of 16 either way
    assert layout_hash(one_page) == layout_hash(KPOOL)
    two_pages = dataclasses.replace(KPOOL, block_size=256, kernel_page_states=32)
    assert layout_hash(two_pages) != layout_hash(dataclasses.replace(KPOOL, block_size=256))
    assert layout_differences(BlockLayout(two_pages).describe(),
                              BlockLayout(dataclasses.replace(KPOOL, block_size=256)).describe()) == [
        "layout_hash", "states_per_page"]
