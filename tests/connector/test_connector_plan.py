"""Transfer plans against a brute-force per-byte copy (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kpool_pd.connector.shared.plan import PoolKind, RingRange, plan_transfer, ring_live_range
from kpool_pd.kvcache import BlockLayout, CacheConfig, CacheFamily

import pytest

CONFIGS = {
    "kpool4-spec3-2layers": CacheConfig(layer_names=("a", "b"), block_size=64, kpool=4, num_spec=3, mla_entry_bytes=16),
    "kpool2-spec0": CacheConfig(block_size=32, kpool=2, num_spec=0, mla_entry_bytes=16),
    "qsa-r3-spec2": CacheConfig(family=CacheFamily.QSA, block_size=48, compress_ratio=3, num_spec=2, mla_entry_bytes=16, qsa_head_size=64),
}


def _flat(pool: dict[PoolKind, torch.Tensor], kind: PoolKind) -> torch.Tensor:
    return pool[kind].view(-1)


@st.composite
def transfers(draw):
    name = draw(st.sampled_from(sorted(CONFIGS)))
    config = CONFIGS[name]
    n_src, n_dst = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    count = draw(st.integers(0, min(n_src, n_dst)))
    src = draw(st.permutations(range(n_src)))[:count]
    dst = draw(st.permutations(range(n_dst)))[:count]
    # Bias toward runs: sometimes sort both sides so that consecutive ids appear.
    if draw(st.booleans()):
        src, dst = sorted(src), sorted(dst)
    prompt_len = draw(st.integers(0, 3 * config.ring_slots + 5))
    rings = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    src_ring = draw(st.integers(0, rings[0] - 1))
    dst_ring = draw(st.integers(0, rings[1] - 1))
    seed = draw(st.integers(0, 2**31))
    return name, n_src, n_dst, list(src), list(dst), rings, src_ring, dst_ring, prompt_len, seed


@settings(max_examples=60, deadline=None)
@given(transfers())
def test_plan_equals_brute_force_copy(case):
    name, n_src, n_dst, src, dst, rings, src_ring, dst_ring, prompt_len, seed = case
    config = CONFIGS[name]
    layout = BlockLayout(config)
    g = torch.Generator().manual_seed(seed)
    src_pool = {
        PoolKind.BLOCKS: torch.randint(0, 256, (n_src, layout.block_bytes), dtype=torch.uint8, generator=g),
        PoolKind.RINGS: torch.randint(0, 256, (rings[0], layout.ring_block_bytes), dtype=torch.uint8, generator=g),
    }
    dst_pool = {
        PoolKind.BLOCKS: torch.randint(0, 256, (n_dst, layout.block_bytes), dtype=torch.uint8, generator=g),
        PoolKind.RINGS: torch.randint(0, 256, (rings[1], layout.ring_block_bytes), dtype=torch.uint8, generator=g),
    }
    expected = {k: v.clone() for k, v in dst_pool.items()}
    # Brute force: every byte of every block, then every live position's slot, byte by byte.
    for s, d in zip(src, dst):
        for b in range(layout.block_bytes):
            expected[PoolKind.BLOCKS][d, b] = src_pool[PoolKind.BLOCKS][s, b]
    group = config.kpool if config.family is CacheFamily.KPOOL else config.compress_ratio
    for pos in range(prompt_len // group * group, prompt_len):
        slot = pos % layout.ring_slots
        for b in range(slot * layout.ring_slot_bytes, (slot + 1) * layout.ring_slot_bytes):
            expected[PoolKind.RINGS][dst_ring, b] = src_pool[PoolKind.RINGS][src_ring, b]

    live = ring_live_range(config, prompt_len)
    plan = plan_transfer(layout, src, dst, src_ring, dst_ring, live,
                         src_num_blocks=n_src, dst_num_blocks=n_dst, src_num_rings=rings[0], dst_num_rings=rings[1])
    for pair in plan.pairs:
        assert pair.src.kind is pair.dst.kind and pair.src.nbytes == pair.dst.nbytes > 0
        s = _flat(src_pool, pair.src.kind)[pair.src.offset:pair.src.offset + pair.src.nbytes]
        _flat(dst_pool, pair.dst.kind)[pair.dst.offset:pair.dst.offset + pair.dst.nbytes] = s
    assert torch.equal(dst_pool[PoolKind.BLOCKS], expected[PoolKind.BLOCKS])
    assert torch.equal(dst_pool[PoolKind.RINGS], expected[PoolKind.RINGS])

    # Coalescing is maximal: one block region per run where both sides are consecutive.
    runs = sum(1 for i in range(len(src)) if i == 0 or not (src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1))
    ring_pieces = [p for p in plan.pairs if p.src.kind is PoolKind.RINGS]
    assert len(plan.pairs) - len(ring_pieces) == runs
    assert len(ring_pieces) <= 2
    assert plan.ring_empty == (prompt_len % group == 0) == (not ring_pieces)


@pytest.mark.parametrize("prompt_len,expected", [
    (0, RingRange(0, 0)), (1, RingRange(0, 1)), (3, RingRange(0, 3)), (4, RingRange(0, 0)),
    (7, RingRange(4, 3)), (8, RingRange(0, 0)), (9, RingRange(0, 1)), (30, RingRange(4, 2)),
], ids=lambda v: str(v))
def test_ring_live_range_kpool4_ring8(prompt_len, expected):
    config = CONFIGS["kpool4-spec3-2layers"]  # R = 4 * next_pow2(ceil(7/4)) = 8
    assert config.ring_slots == 8
    assert ring_live_range(config, prompt_len) == expected


def test_ring_wraps_into_two_pieces():
    config = CONFIGS["qsa-r3-spec2"]  # C = 3 * ceil(5/3) = 6: group [6k+3, 6k+6) never wraps; r=3 divides 6
    layout = BlockLayout(config)
    assert config.ring_slots == 6
    wrap = plan_transfer(layout, [], [], 0, 0, RingRange(start_slot=5, num_slots=2))
    assert [(p.src.offset, p.src.nbytes) for p in wrap.pairs] == [
        (5 * layout.ring_slot_bytes, layout.ring_slot_bytes), (0, layout.ring_slot_bytes)]


@pytest.mark.parametrize("bad", ["repeat", "range", "length"])
def test_plan_rejects_bad_ids(bad):
    layout = BlockLayout(CONFIGS["kpool2-spec0"])
    src, dst = {"repeat": ([1, 1], [0, 1]), "range": ([0, 9], [0, 1]), "length": ([0, 1], [0])}[bad]
    with pytest.raises(ValueError, match=r"twice|outside|destination blocks"):
        plan_transfer(layout, src, dst, 0, 0, RingRange(0, 0), src_num_blocks=4, dst_num_blocks=4)
