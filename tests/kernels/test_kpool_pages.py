"""Kernel pages: the bytes a prefill writes, read back with DESIGN section 2's formula written out here.

The expected offsets come from DESIGN (sections 2 and 4), not from kvcache or kernels: per layer a block holds
the MLA page (block_size * 656 B) and then the indexer pages, each start 16-byte aligned; the indexer pages are
S / P kernel pages of P states (one page of S states when S <= P), each ``[P x 128 fp8][P x 4 fp32]``; pool p
of a request lives in block ``block_table[p * kpool // block_size]``, state ``s = p % S``, entry ``s % P`` of
kernel page ``s // P``. The expected entries come from the compression reference alone.
"""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kernels import kpool_prefill
from kpool_pd.kernels.kpool_compress.ref import compress_pools
from kpool_pd.kvcache import BlockLayout, CacheConfig, CachePool, PoolMode
from tests.support.kernel_backends import ALL_BACKENDS, REFERENCE, Backend, make_backend, poison

D, MLA_ENTRY = 128, 656


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def expected_entry_offsets(*, layer: int, pool: int, block_table: list[int], block_size: int, kpool: int,
                           page_states: int) -> tuple[int, int, int]:
    """(block id, byte offset of the entry's 128 fp8 bytes, byte offset of its fp32 scale) inside the block."""
    states = block_size // kpool
    per_page = min(states, page_states)
    layer_bytes = _align16(block_size * MLA_ENTRY) + _align16(states * (D + 4))
    indexer = layer * layer_bytes + _align16(block_size * MLA_ENTRY)
    block = block_table[pool * kpool // block_size]
    state = pool % states
    page_start = indexer + (state // per_page) * per_page * (D + 4)
    entry = state % per_page
    return block, page_start + entry * D, page_start + per_page * D + entry * 4


GEOMETRY = [  # (kpool, block_size, P, tokens): kpool 2 with 256-token blocks is two pages of 64 (or four of 32)
    pytest.param(2, 256, 64, 2 * 256 + 135, id="kpool2-block256-two-pages-of-64"),
    pytest.param(2, 256, 32, 2 * 256 + 135, id="kpool2-block256-four-pages-of-32"),
    pytest.param(4, 128, 64, 128 + 70, id="kpool4-block128-one-page-of-32"),
]


# The kernels' softmax entries match the reference by a rule, not bytes (test_kpool_triton.py): the kernels run
# keep_last here, the reference both modes.
BACKEND_MODES = [pytest.param(b.values[0], mode, id=f"{b.id}-{mode.value}", marks=b.marks) for b in ALL_BACKENDS
                 for mode in PoolMode if b.values[0] == REFERENCE or mode is PoolMode.KEEP_LAST]


@pytest.mark.parametrize("backend,mode", BACKEND_MODES, indirect=["backend"])
@pytest.mark.parametrize("kpool,block_size,page_states,tokens", GEOMETRY)
def test_prefill_writes_each_entry_where_design_says(backend, mode, kpool, block_size, page_states, tokens):
    config = CacheConfig(layer_names=("l0", "l1"), kpool=kpool, block_size=block_size, num_spec=3, pool_mode=mode,
                         kernel_page_states=page_states)
    blocks = -(-tokens // block_size)
    pool = CachePool(BlockLayout(config), num_blocks=2 * blocks + 1, num_rings=2, device=backend.device)
    poison(pool.blocks, 11)
    poison(pool.rings, 12)
    before = pool.blocks.cpu().clone()
    table = [2 * i + 1 for i in reversed(range(blocks))]  # scattered, descending block ids
    gen = torch.Generator().manual_seed(tokens)
    k = torch.randn(tokens, D, generator=gen).to(torch.bfloat16)
    gate = (2 * torch.randn(tokens, D, generator=gen)).to(torch.bfloat16)
    ape = torch.randn(kpool, D, generator=gen)
    dev = backend.device
    kpool_prefill(k.to(dev), gate.to(dev), ape.to(dev), torch.tensor([0, tokens], device=dev),
                  torch.tensor([table], dtype=torch.int32, device=dev), torch.tensor([1], device=dev),
                  pool.indexer_q(1), pool.indexer_scale(1), pool.tail_ring(1), mode=mode)
    pools = tokens // kpool
    q, scale = compress_pools(k[: pools * kpool].view(pools, kpool, D), gate[: pools * kpool].view(pools, kpool, D),
                              ape, mode=mode, round_scale=True)
    got = pool.blocks.cpu()
    written = torch.zeros_like(got, dtype=torch.bool)
    for p in range(pools):
        block, q_at, scale_at = expected_entry_offsets(layer=1, pool=p, block_table=table, block_size=block_size,
                                                       kpool=kpool, page_states=page_states)
        assert torch.equal(got[block, q_at:q_at + D], q[p].view(torch.uint8)), f"pool {p}: fp8 bytes"
        assert torch.equal(got[block, scale_at:scale_at + 4], scale[p:p + 1].view(torch.uint8)), f"pool {p}: scale"
        written[block, q_at:q_at + D] = True
        written[block, scale_at:scale_at + 4] = True
    assert int(written.sum()) == pools * (D + 4), "two pools landed on the same bytes"
    assert torch.equal(got[~written], before[~written]), "a byte outside the pools' entries changed"


def test_views_alias_the_kernel_pages_design_describes():
    """Write state s of a block through the typed views; its bytes land where DESIGN's formula puts them."""
    config = CacheConfig(layer_names=("l0", "l1", "l2"), kpool=2, block_size=256, num_spec=3)
    pool = CachePool(BlockLayout(config), num_blocks=3, num_rings=1)
    assert pool.indexer_q(0).shape == (3, 2, 64, D) and pool.indexer_scale(0).shape == (3, 2, 64)
    for state in (0, 63, 64, 127):
        pool.blocks.zero_()
        pool.indexer_q(2)[1, state // 64, state % 64] = torch.full((D,), 1.0).to(torch.float8_e4m3fn)
        pool.indexer_scale(2)[1, state // 64, state % 64] = 2.0
        _, q_at, scale_at = expected_entry_offsets(layer=2, pool=state, block_table=[1], block_size=256, kpool=2,
                                                   page_states=64)
        assert torch.equal(pool.blocks[1, q_at:q_at + D], torch.full((D,), 0x38, dtype=torch.uint8))  # 1.0 in e4m3
        assert pool.blocks[1, scale_at:scale_at + 4].view(torch.float32).item() == 2.0
        assert int(pool.blocks.count_nonzero()) == D + 1  # 128 code bytes; 2.0 is 0x40000000, one nonzero byte
