"""Spec validation: every invalid config is refused with the numbers in the message."""

from __future__ import annotations

import pytest

from kpool_pd.kvcache import (
    CacheConfig, CacheDtype, CacheFamily, KpoolIndexerSpec, QsaCompressedKeySpec, TailRingSpec, qsa_ring_capacity,
    tail_ring_size,
)


@pytest.mark.parametrize(
    "kpool, num_spec, expected",
    [(2, 0, 2), (4, 0, 4), (4, 1, 8), (4, 3, 8), (4, 4, 8), (4, 5, 16), (2, 7, 16), (8, 7, 16), (8, 9, 32)],
)
def test_tail_ring_size(kpool, num_spec, expected):
    assert tail_ring_size(kpool, num_spec) == expected
    assert expected >= kpool + num_spec


@pytest.mark.parametrize("ratio, num_spec, expected", [(1, 0, 1), (1, 3, 4), (4, 0, 4), (4, 3, 8), (3, 4, 9), (8, 7, 16)])
def test_qsa_ring_capacity(ratio, num_spec, expected):
    assert qsa_ring_capacity(ratio, num_spec) == expected


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TailRingSpec(kpool=4, num_spec=5, block_size=8), r"R = 16 .* does not divide block_size 8"),
        (lambda: KpoolIndexerSpec(kpool=4, block_size=4 * 96),
         r"S = .* = 96 exceeds the kernel page of 64 .* not a multiple"),
        (lambda: KpoolIndexerSpec(kpool=2, block_size=2 * 80, kernel_page_states=32),
         r"S = .* = 80 exceeds the kernel page of 32 states and is not a multiple"),
        (lambda: KpoolIndexerSpec(kpool=4, block_size=256, kernel_page_states=16),
         r"kernel_page_states must be one of \(32, 64\).* got 16"),
        (lambda: CacheConfig(kpool=4, block_size=256, kernel_page_states=128),
         r"kernel_page_states must be one of .* got 128"),
        (lambda: KpoolIndexerSpec(kpool=3, block_size=64), "block_size 64 is not a multiple of kpool 3"),
        (lambda: KpoolIndexerSpec(kpool=0, block_size=64), "kpool must be a positive integer, got 0"),
        (lambda: KpoolIndexerSpec(kpool=4, block_size=-64), "block_size must be a positive integer, got -64"),
        (lambda: QsaCompressedKeySpec(compress_ratio=3, block_size=64), "block_size 64 is not a multiple of compress_ratio 3"),
        (lambda: QsaCompressedKeySpec(compress_ratio=0, block_size=64), "compress_ratio must be a positive integer, got 0"),
        (lambda: QsaCompressedKeySpec(compress_ratio=4, block_size=64, head_size=0), "head_size must be a positive integer, got 0"),
        (lambda: CacheConfig(layer_names=("a", "b", "a")), r"duplicate layer name 'a'"),
        (lambda: CacheConfig(family=CacheFamily.QSA, compress_ratio=4, num_spec=5, block_size=64),
         r"C = 12 .* does not divide block_size 64"),
        (lambda: tail_ring_size(4, -1), "num_spec must be an integer >= 0, got -1"),
    ],
    ids=["ring-not-dividing", "S-not-multiple-of-page", "S-not-multiple-of-page32", "page-16", "page-128",
         "block-not-multiple", "kpool-zero", "block-negative",
         "qsa-block-not-multiple", "qsa-ratio-zero", "qsa-head-zero", "duplicate-layer", "qsa-ring-not-dividing",
         "negative-spec"],
)
def test_invalid_configs_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_fp8_aliases_store_the_same_bytes():
    assert CacheDtype.FP8.canonical is CacheDtype.FP8_E4M3
    assert CacheDtype.AUTO.canonical is CacheDtype.BFLOAT16
    assert QsaCompressedKeySpec(compress_ratio=4, block_size=64, dtype=CacheDtype.FP8).page_bytes == 16 * 128


@pytest.mark.parametrize("states, page, pages, per_page", [
    (16, 64, 1, 16), (48, 64, 1, 48), (64, 64, 1, 64), (128, 64, 2, 64), (256, 64, 4, 64),
    (32, 32, 1, 32), (64, 32, 2, 32), (96, 32, 3, 32), (128, 32, 4, 32), (16, 32, 1, 16),
], ids=lambda v: str(v))
def test_kernel_pages_split_blocks_of_more_states_than_a_page(states, page, pages, per_page):
    spec = KpoolIndexerSpec(kpool=2, block_size=2 * states, kernel_page_states=page)
    assert (spec.pages_per_block, spec.states_per_page) == (pages, per_page)
    assert spec.kernel_page_bytes == per_page * 132 and spec.page_bytes == states * 132
