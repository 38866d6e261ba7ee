"""The per-family object (``CacheConfig.family_spec``) and the token arithmetic both families share.

Expected values come from the page and ring specs built here directly, or from brute force over
positions, never from the code under test.
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from kpool_pd.kvcache import (
    BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, KpoolFamilySpec, KpoolIndexerSpec, PoolMode,
    QsaCompressedKeySpec, QsaFamilySpec, QsaKeyStateRingSpec, TailRingSpec, complete_entries,
    family_spec_type, layout_hash, open_entry_start,
)

KPOOL_CONFIGS = {
    "kpool2-spec0-b32": CacheConfig(block_size=32, kpool=2, num_spec=0),
    "kpool4-spec3-b64": CacheConfig(layer_names=("a", "b", "c"), block_size=64, kpool=4, num_spec=3),
    "kpool4-spec5-b256-keeplast": CacheConfig(block_size=256, kpool=4, num_spec=5, pool_mode=PoolMode.KEEP_LAST,
                                              round_scale=False, order=BlockOrder.BLHNC, mla_num_heads=2),
    "kpool8-spec7-b512": CacheConfig(block_size=512, kpool=8, num_spec=7, mla_entry_bytes=600),
    "kpool2-spec3-b256-2pages": CacheConfig(block_size=256, kpool=2, num_spec=3),
    "kpool4-spec3-b512-p32": CacheConfig(block_size=512, kpool=4, num_spec=3, kernel_page_states=32),
}
QSA_CONFIGS = {
    "qsa1-spec0-b16": CacheConfig(family=CacheFamily.QSA, block_size=16, compress_ratio=1, num_spec=0),
    "qsa3-spec2-b48-d64": CacheConfig(family=CacheFamily.QSA, block_size=48, compress_ratio=3, num_spec=2,
                                      qsa_head_size=64),
    "qsa4-spec3-b64-fp8-2heads": CacheConfig(family=CacheFamily.QSA, layer_names=("x", "y"), block_size=64,
                                             compress_ratio=4, num_spec=3, qsa_dtype=CacheDtype.FP8,
                                             qsa_num_heads=2, order=BlockOrder.BLHNC),
    "qsa4-spec0-b64-nopos-d130": CacheConfig(family=CacheFamily.QSA, block_size=64, compress_ratio=4, num_spec=0,
                                             qsa_head_size=130, cache_rope_positions=False),
}
ALL_CONFIGS = KPOOL_CONFIGS | QSA_CONFIGS


def _kpool_specs(c: CacheConfig) -> tuple[KpoolIndexerSpec, TailRingSpec]:
    return (KpoolIndexerSpec(kpool=c.kpool, block_size=c.block_size, mode=c.pool_mode, round_scale=c.round_scale,
                             kernel_page_states=c.kernel_page_states),
            TailRingSpec(kpool=c.kpool, num_spec=c.num_spec, block_size=c.block_size))


def _qsa_specs(c: CacheConfig) -> tuple[QsaCompressedKeySpec, QsaKeyStateRingSpec]:
    return (QsaCompressedKeySpec(compress_ratio=c.compress_ratio, block_size=c.block_size, head_size=c.qsa_head_size,
                                 num_heads=c.qsa_num_heads, dtype=c.qsa_dtype, order=c.order),
            QsaKeyStateRingSpec(compress_ratio=c.compress_ratio, num_spec=c.num_spec, block_size=c.block_size,
                                head_size=c.qsa_head_size, num_heads=c.qsa_num_heads,
                                cache_rope_positions=c.cache_rope_positions))


@pytest.mark.parametrize("name", sorted(KPOOL_CONFIGS))
def test_kpool_family_answers_what_its_specs_say(name):
    config = KPOOL_CONFIGS[name]
    indexer, ring = _kpool_specs(config)
    spec = config.family_spec
    assert isinstance(spec, KpoolFamilySpec) and spec.family is CacheFamily.KPOOL
    assert spec.page_bytes == indexer.page_bytes == (config.block_size // config.kpool) * (128 + 4)
    assert spec.ring_slots == ring.ring_size
    assert spec.ring_row_bytes == ring.row_bytes == 2 * 128 * 2  # K and gate, bf16
    assert spec.tokens_per_entry == indexer.kpool == config.kpool
    assert spec.entries_per_block == indexer.states_per_block
    states, page = config.block_size // config.kpool, config.kernel_page_states
    pages = states // page if states > page else 1  # S <= P: one page of S states; else S / P pages of P
    assert (spec.pages_per_block, spec.states_per_page) == (pages, states // pages)
    assert indexer.kernel_page_bytes * pages == indexer.page_bytes
    rows, heads, row_bytes = spec.page_axes
    assert rows * heads * row_bytes == indexer.page_bytes
    assert (config.indexer_page_bytes, config.ring_slots, config.ring_row_bytes, config.tokens_per_entry) == (
        indexer.page_bytes, ring.ring_size, ring.row_bytes, indexer.kpool)


@pytest.mark.parametrize("name", sorted(QSA_CONFIGS))
def test_qsa_family_answers_what_its_specs_say(name):
    config = QSA_CONFIGS[name]
    keys, ring = _qsa_specs(config)
    spec = config.family_spec
    assert isinstance(spec, QsaFamilySpec) and spec.family is CacheFamily.QSA
    element = 1 if config.qsa_dtype.canonical is CacheDtype.FP8_E4M3 else 2
    rows = config.block_size // config.compress_ratio
    assert spec.page_bytes == keys.page_bytes == rows * config.qsa_num_heads * config.qsa_head_size * element
    assert spec.ring_slots == ring.capacity
    width = math.ceil(config.qsa_head_size / 4) * 4 + 12 if config.cache_rope_positions else config.qsa_head_size
    assert spec.ring_row_bytes == ring.row_bytes == config.qsa_num_heads * width * 2
    assert spec.tokens_per_entry == keys.compress_ratio == config.compress_ratio
    assert spec.entries_per_block == keys.rows_per_block == rows
    assert spec.page_axes == (rows, config.qsa_num_heads, config.qsa_head_size * element)
    assert (config.indexer_page_bytes, config.ring_slots, config.ring_row_bytes, config.tokens_per_entry) == (
        keys.page_bytes, ring.capacity, ring.row_bytes, keys.compress_ratio)


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_what_is_known_before_a_block_size_agrees_with_the_built_spec(name):
    config = ALL_CONFIGS[name]
    kind = family_spec_type(config.family)
    assert isinstance(config.family_spec, kind)
    group = kind.tokens_per_entry_for(kpool=config.kpool, compress_ratio=config.compress_ratio)
    assert group == config.family_spec.tokens_per_entry
    assert kind.ring_slots_for(group, config.num_spec) == config.family_spec.ring_slots


def _expected_hash_fields(c: CacheConfig) -> dict[str, object]:
    fields: dict[str, object] = {
        "format_version": c.format_version, "family": c.family.value, "layer_names": list(c.layer_names),
        "block_size": c.block_size, "num_spec": c.num_spec, "mla_entry_bytes": c.mla_entry_bytes,
        "mla_num_heads": c.mla_num_heads, "order": c.order.value,
    }
    if c.family is CacheFamily.KPOOL:
        indexer, ring = _kpool_specs(c)
        fields |= {"kpool": indexer.kpool, "pool_mode": indexer.mode.value, "round_scale": indexer.round_scale,
                   "states_per_block": indexer.states_per_block,
                   "states_per_page": min(indexer.states_per_block, c.kernel_page_states),
                   "ring_size": ring.ring_size}
    else:
        keys, ring = _qsa_specs(c)
        fields |= {"compress_ratio": keys.compress_ratio, "qsa_head_size": keys.head_size,
                   "qsa_num_heads": keys.num_heads, "qsa_dtype": keys.dtype.canonical.value,
                   "cache_rope_positions": ring.cache_rope_positions, "ring_capacity": ring.capacity,
                   "rotary_dim": keys.rotary_dim, "mrope_section": list(keys.mrope_section),
                   "rope_theta": keys.rope_theta, "norm_eps": keys.norm_eps}
    return fields


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_hash_fields_and_layout_hash_come_from_the_specs(name):
    config = ALL_CONFIGS[name]
    expected = _expected_hash_fields(config)
    assert config.hash_fields() == expected
    canonical = json.dumps(expected, sort_keys=True, separators=(",", ":"))
    assert layout_hash(config) == hashlib.sha256(canonical.encode()).hexdigest()
    assert BlockLayout(config).describe()["layout_hash"] == layout_hash(config)


def test_the_families_hash_disjoint_fields():
    kpool = KPOOL_CONFIGS["kpool4-spec3-b64"].family_spec.hash_fields()
    qsa = QSA_CONFIGS["qsa4-spec3-b64-fp8-2heads"].family_spec.hash_fields()
    assert not set(kpool) & set(qsa)


def test_family_specs_refuse_parts_that_disagree():
    indexer, ring = _kpool_specs(KPOOL_CONFIGS["kpool4-spec3-b64"])
    with pytest.raises(ValueError, match=r"indexer \(kpool 4, block_size 64\) and ring \(kpool 2, block_size 64\)"):
        KpoolFamilySpec(indexer=indexer, ring=TailRingSpec(kpool=2, num_spec=3, block_size=64))
    with pytest.raises(TypeError, match="ring must be a TailRingSpec, got QsaKeyStateRingSpec"):
        KpoolFamilySpec(indexer=indexer, ring=_qsa_specs(QSA_CONFIGS["qsa4-spec3-b64-fp8-2heads"])[1])
    keys, _ = _qsa_specs(QSA_CONFIGS["qsa4-spec3-b64-fp8-2heads"])
    with pytest.raises(ValueError, match=r"keys .* = \(4, 64, 128, 2\) and ring \(4, 64, 128, 1\) disagree"):
        QsaFamilySpec(keys=keys, ring=QsaKeyStateRingSpec(compress_ratio=4, num_spec=3, block_size=64))
    with pytest.raises(ValueError, match="family must be a CacheFamily, got 'kpool'"):
        family_spec_type("kpool")


# Token arithmetic -------------------------------------------------------------------------------

def _brute_blocks(n: int, block_size: int) -> int:
    blocks = 0
    while blocks * block_size < n:
        blocks += 1
    return blocks


def _brute_complete(n: int, group: int) -> int:
    return sum(1 for entry in range(n + 1) if (entry + 1) * group <= n)


def _brute_open_start(n: int, group: int) -> int:
    return max(p for p in range(n + 1) if p % group == 0)


def _edges(group: int, block_size: int) -> list[int]:
    return sorted({0, 1, group - 1, group, group + 1, block_size - 1, block_size, block_size + 1} - {-1})


@pytest.mark.parametrize("name", ["kpool4-spec3-b64", "kpool2-spec0-b32", "qsa3-spec2-b48-d64", "qsa1-spec0-b16"])
def test_token_arithmetic_at_the_edges(name):
    config = ALL_CONFIGS[name]
    group, block_size = config.tokens_per_entry, config.block_size
    for n in _edges(group, block_size):
        assert config.blocks_for_tokens(n) == _brute_blocks(n, block_size), n
        blocks = config.blocks_for_tokens(n)
        assert config.max_cached_tokens(blocks) >= n and (n == 0 or config.max_cached_tokens(blocks - 1) < n), n
        assert config.complete_entries(n) == complete_entries(n, group) == _brute_complete(n, group), n
        assert config.open_entry_start(n) == open_entry_start(n, group) == _brute_open_start(n, group), n
        assert config.family_spec.open_entry_start(n) == config.open_entry_start(n)


@pytest.mark.parametrize("n, expected", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 1), (63, 1), (64, 1), (65, 2), (128, 2),
                                         (129, 3)], ids=lambda v: str(v))
def test_blocks_for_tokens_kpool4_block64(n, expected):
    assert KPOOL_CONFIGS["kpool4-spec3-b64"].blocks_for_tokens(n) == expected


@pytest.mark.parametrize("name", ["kpool4-spec3-b64", "qsa3-spec2-b48-d64"])
def test_a_request_holds_the_blocks_of_its_prompt_plus_outputs_minus_one_positions(name):
    config = ALL_CONFIGS[name]
    block = config.block_size
    for prompt_len, max_tokens in [(1, 1), (1, 2), (block - 1, 1), (block, 1), (block, 2), (block + 1, 1),
                                   (block - 1, 3), (2 * block, block + 1), (0, 1)]:
        positions = prompt_len + max_tokens - 1  # the last output token is never written
        assert config.positions_written(prompt_len, max_tokens) == positions
        expected = next(b for b in range(positions + 2) if b * block >= positions)
        assert config.blocks_for_request(prompt_len, max_tokens) == expected, (prompt_len, max_tokens)
    with pytest.raises(ValueError, match="0 prompt and 0 new tokens writes -1 positions"):
        config.blocks_for_request(0, 0)


@pytest.mark.parametrize("n, start", [(0, 0), (1, 0), (2, 0), (3, 3), (4, 3), (47, 45), (48, 48), (49, 48)],
                         ids=lambda v: str(v))
def test_open_entry_start_qsa_ratio3(n, start):
    config = QSA_CONFIGS["qsa3-spec2-b48-d64"]
    assert config.open_entry_start(n) == start
    assert config.complete_entries(n) == start // 3


def test_tensor_counts_work_elementwise():
    config = KPOOL_CONFIGS["kpool4-spec3-b64"]
    counts = torch.tensor([0, 1, 3, 4, 5, 63, 64, 65], dtype=torch.int64)
    assert config.blocks_for_tokens(counts).tolist() == [config.blocks_for_tokens(int(n)) for n in counts]
    assert config.open_entry_start(counts).tolist() == [config.open_entry_start(int(n)) for n in counts]
    assert config.complete_entries(counts.to(torch.int32)).tolist() == [config.complete_entries(int(n)) for n in counts]
    with pytest.raises(TypeError, match="integer tensor, got dtype torch.float32"):
        config.open_entry_start(counts.float())


@pytest.mark.parametrize("bad", [-1, 2.0, True, "3"], ids=["negative", "float", "bool", "str"])
def test_counts_must_be_integers_at_least_zero(bad):
    config = KPOOL_CONFIGS["kpool4-spec3-b64"]
    for call in (config.blocks_for_tokens, config.complete_entries, config.open_entry_start):
        with pytest.raises(ValueError, match=f"num_tokens must be an integer >= 0, got {bad!r}"):
            call(bad)
    with pytest.raises(ValueError, match=f"num_blocks must be an integer >= 0, got {bad!r}"):
        config.max_cached_tokens(bad)
    with pytest.raises(ValueError, match="tokens_per_entry must be a positive integer, got 0"):
        open_entry_start(3, 0)
