"""Block repack between BLNHC and BLHNC (kernels.repack_blocks), on both paths.

Pure byte movement: the reference and the Triton kernel (in the interpreter) must give exactly the
bytes of a per-layer copy through the pools' typed views (``CachePool.mla`` / ``qsa_keys`` /
``indexer_page``, which present one logical order whatever the storage order), and leave every
other destination byte (other blocks, the padding between pages) as it was.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import repack_blocks
from kvcache import BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool

BLNHC, BLHNC = BlockOrder.BLNHC, BlockOrder.BLHNC
CONFIGS = {
    "qsa-bf16-2heads": dict(family=CacheFamily.QSA, block_size=16, mla_entry_bytes=20, mla_num_heads=2,
                            qsa_num_heads=2, qsa_head_size=72, compress_ratio=4),
    "qsa-fp8-3heads-odd-entry": dict(family=CacheFamily.QSA, block_size=8, mla_entry_bytes=7, mla_num_heads=3,
                                     qsa_num_heads=3, qsa_head_size=64, qsa_dtype=CacheDtype.FP8_E4M3,
                                     compress_ratio=2),
    "kpool-4heads": dict(family=CacheFamily.KPOOL, block_size=64, mla_entry_bytes=24, mla_num_heads=4, kpool=4),
    "qsa-1head": dict(family=CacheFamily.QSA, block_size=8, mla_entry_bytes=656, compress_ratio=4),
}


def _pool(config: CacheConfig, num_blocks: int, seed: int) -> CachePool:
    pool = CachePool(BlockLayout(config), num_blocks=num_blocks, num_rings=1)
    pool.blocks.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return pool


def _view_copy(src: CachePool, dst: CachePool, src_ids: list[int], dst_ids: list[int]) -> None:
    """The expected result: each layer's pages copied through the typed views (logical order)."""
    for layer in range(len(src.layout.layers)):
        dst.mla(layer)[dst_ids] = src.mla(layer)[src_ids]
        if src.config.family is CacheFamily.QSA:
            bits = torch.uint8 if src.config.qsa_keys.element_bytes == 1 else torch.int16
            dst.qsa_keys(layer).view(bits)[dst_ids] = src.qsa_keys(layer).view(bits)[src_ids]
        else:
            dst.indexer_page(layer)[dst_ids] = src.indexer_page(layer)[src_ids]


@pytest.fixture(params=["reference", "triton"])
def path(request, monkeypatch):
    if request.param == "triton":
        request.getfixturevalue("force_triton")
    return request.param


@pytest.mark.parametrize("orders", [(BLNHC, BLHNC), (BLHNC, BLNHC), (BLNHC, BLNHC), (BLHNC, BLHNC)],
                         ids=lambda o: f"{o[0].value}-to-{o[1].value}")
@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_repack_matches_view_copy(path, name, orders):
    base = CacheConfig(layer_names=("l0", "l1", "l2"), **CONFIGS[name])
    src = _pool(dataclasses.replace(base, order=orders[0]), 6, seed=1)
    got = _pool(dataclasses.replace(base, order=orders[1]), 7, seed=2)
    want = _pool(got.config, 7, seed=2)
    src_ids, dst_ids = [4, 0, 5, 2], [1, 6, 0, 3]  # non-contiguous, reordered
    repack_blocks(src.blocks, src.layout, torch.tensor(src_ids), got.blocks, got.layout, torch.tensor(dst_ids))
    _view_copy(src, want, src_ids, dst_ids)
    assert torch.equal(got.blocks, want.blocks)


def test_repack_single_block_and_python_ids(path):
    base = CacheConfig(layer_names=("l0",), **CONFIGS["qsa-bf16-2heads"])
    src = _pool(base, 1, seed=3)
    got = _pool(dataclasses.replace(base, order=BLHNC), 1, seed=4)
    want = _pool(got.config, 1, seed=4)
    repack_blocks(src.blocks, src.layout, [0], got.blocks, got.layout, [0])
    _view_copy(src, want, [0], [0])
    assert torch.equal(got.blocks, want.blocks)
    repack_blocks(src.blocks, src.layout, [], got.blocks, got.layout, [])  # nothing to move
    assert torch.equal(got.blocks, want.blocks)


def _layouts():
    base = CacheConfig(layer_names=("l0", "l1"), **CONFIGS["qsa-bf16-2heads"])
    return base, BlockLayout(base), BlockLayout(dataclasses.replace(base, order=BLHNC))


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"dst_layout": "block_size"}, ValueError, r"differ only in order; they also differ in \['block_size'"),
        ({"src_blocks": "int8"}, ValueError, "src_blocks must be contiguous uint8"),
        ({"dst_blocks": "narrow"}, ValueError, "dst_blocks must be contiguous uint8"),
        ({"dst_block_ids": [0]}, ValueError, "src_block_ids has 2 ids, dst_block_ids 1"),
        ({"src_block_ids": [0, 3]}, ValueError, r"src_block_ids must lie in \[0, 3\), got range \[0, 3\]"),
        ({"dst_block_ids": [1, 1]}, ValueError, "dst_block_ids name a block twice"),
        ({"src_block_ids": torch.tensor([0.0, 1.0])}, ValueError, "1-D int32 or int64"),
        ({"src_layout": "config"}, TypeError, "src_layout must be a BlockLayout"),
    ],
    ids=["layouts-differ", "int8-src", "narrow-dst", "id-counts", "src-id-past-pool", "dst-twice", "float-ids",
         "config-not-layout"],
)
def test_rejects_bad_inputs(path, change, error, match):
    base, src_layout, dst_layout = _layouts()
    args = {"src_blocks": torch.zeros(3, src_layout.block_bytes, dtype=torch.uint8), "src_layout": src_layout,
            "src_block_ids": [0, 1], "dst_blocks": torch.zeros(3, dst_layout.block_bytes, dtype=torch.uint8),
            "dst_layout": dst_layout, "dst_block_ids": [2, 0]}
    for key, value in change.items():
        if value == "block_size":
            value = BlockLayout(dataclasses.replace(base, order=BLHNC, block_size=32))
        elif value == "int8":
            value = args["src_blocks"].to(torch.int8)
        elif value == "narrow":
            value = args["dst_blocks"][:, 1:]
        elif value == "config":
            value = base
        args[key] = value
    with pytest.raises(error, match=match):
        repack_blocks(**args)
