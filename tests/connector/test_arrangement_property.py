"""Property: a pull between two arrangements of one cache (block size, block order, kernel page) moves
every prompt position's state. The connector's own steps, without the network: the plan in the
prefill node's layout copies the source blocks into staging and the ring into place, then
``kernels.repack_tokens`` places the staged prompt into the decode node's blocks. Every layer's MLA
rows, kpool entries and scales (or QSA keys) of positions [0, L) and the ring's live rows must then
read the same through both pools' views, and no other destination block may change."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kpool_pd import kernels
from kpool_pd.connector.shared.plan import PoolKind, plan_transfer, ring_live_range
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool, family_spec_type
from tests.support.connector_procs import live_slots, state_differences


def _config(family: CacheFamily, group: int, drafts: int, heads: int, fp8: bool, block_size: int) -> CacheConfig:
    return CacheConfig(family=family, layer_names=("a", "b"), kpool=group, compress_ratio=group, num_spec=drafts,
                       mla_entry_bytes=12, mla_num_heads=heads, qsa_num_heads=heads, qsa_head_size=64,
                       qsa_dtype=CacheDtype.FP8_E4M3 if fp8 else CacheDtype.BFLOAT16, block_size=block_size)


@st.composite
def pulls(draw):
    family = draw(st.sampled_from(list(CacheFamily)))
    group, drafts = draw(st.sampled_from([2, 4, 8])), draw(st.integers(0, 5))
    unit = math.lcm(group, family_spec_type(family).ring_slots_for(group, drafts))
    base = _config(family, group, drafts, draw(st.sampled_from([1, 2])), draw(st.booleans()), unit)
    sides = []
    for _ in range(2):
        size = unit * draw(st.integers(1, max(1, 512 // unit)))
        try:
            sides.append(BlockLayout(replace(base, block_size=size, order=draw(st.sampled_from(list(BlockOrder))),
                                             kernel_page_states=draw(st.sampled_from([32, 64])))))
        except ValueError:  # S above the kernel page and not a multiple of it
            assume(False)
    prompt_len = draw(st.integers(1, 2 * max(s.config.block_size for s in sides) + group))
    src_ids, dst_ids = (draw(st.permutations(range(s.config.blocks_for_tokens(prompt_len) + 2)))
                        [:s.config.blocks_for_tokens(prompt_len)] for s in sides)
    return sides, prompt_len, src_ids, dst_ids, draw(st.integers(0, 2**31))


@settings(max_examples=60, deadline=None)
@given(pulls())
def test_a_pull_between_arrangements_moves_every_position(case):
    (src_layout, dst_layout), prompt_len, src_ids, dst_ids, seed = case
    g = torch.Generator().manual_seed(seed)
    src = CachePool(src_layout, num_blocks=len(src_ids) + 2, num_rings=2)
    dst = CachePool(dst_layout, num_blocks=len(dst_ids) + 2, num_rings=2)
    for pool in (src, dst):
        pool.blocks.random_(0, 256, generator=g)
        pool.rings.random_(0, 256, generator=g)
    before = dst.blocks.clone()
    staging = torch.empty(len(src_ids), src_layout.block_bytes, dtype=torch.uint8)
    plan = plan_transfer(src_layout, src_ids, list(range(len(src_ids))), 1, 0, ring_live_range(src_layout.config, prompt_len))
    for pair in plan.pairs:
        source = (src.blocks if pair.src.kind is PoolKind.BLOCKS else src.rings).view(-1)
        target = (staging if pair.dst.kind is PoolKind.BLOCKS else dst.rings).view(-1)
        target[pair.dst.offset:pair.dst.offset + pair.dst.nbytes] = source[pair.src.offset:pair.src.offset + pair.src.nbytes]
    kernels.repack_tokens(staging, src_layout, list(range(len(src_ids))), dst.blocks, dst_layout, dst_ids, prompt_len)
    assert state_differences(dst, dst_ids, 0, src, src_ids, 1, live_slots(dst_layout.config, prompt_len),
                             prompt_len) == []
    untouched = [b for b in range(dst.num_blocks) if b not in dst_ids]
    assert torch.equal(dst.blocks[untouched], before[untouched])
