"""Spec validation: every invalid config is refused with the numbers in the message."""

from __future__ import annotations

import pytest

from kvcache import (
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
        (lambda: KpoolIndexerSpec(kpool=4, block_size=4 * 48), r"S = .* = 48 is not one of"),
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
    ids=["ring-not-dividing", "S-not-allowed", "block-not-multiple", "kpool-zero", "block-negative",
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
