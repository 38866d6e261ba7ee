"""Triton prefill of a batch of chunks: compress + paged write of every pool a chunk completes, and the
tail ring left holding the open pool.

Compression runs one program per BLOCK_P consecutive pools of the whole batch (pools numbered
request after request), so one launch covers every request; a program finds each pool's request by
binary search over the per-request pool offsets. No host synchronisation: the grid is sized from
the token count (a batch of B chunks completes at most (T + (kpool - 1) * B) // kpool pools).
With chunk starts (``start_pos``), a pool's positions below its chunk's start are read from the ring
(``compress_tile``'s FROM_RING); the ring is written by the second launch, after every read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.dispatch import interpreting
from kpool_pd.kernels.kpool_cache.triton import entry_offsets, page_strides
from kpool_pd.kernels.kpool_compress.triton import DIM, compress_tile
from kpool_pd.kernels.triton_helpers import launch_options
from kpool_pd.kvcache import PoolMode


@triton.jit
def _prefill_compress_kernel(
    k_ptr, g_ptr, ape_ptr, qsl_ptr, start_ptr, pool_offsets_ptr, table_ptr, ring_ids_ptr, ring_ptr, iq_ptr, is_ptr,
    num_requests, search_steps, table_stride, table_width, states, block_size, iq_block, iq_page, iq_entry, is_block,
    is_page, is_entry, ring_stride, gate_half, slot_stride,
    BLOCK_P: tl.constexpr, PAGE: tl.constexpr, KPOOL: tl.constexpr, SOFTMAX: tl.constexpr, ROUND_SCALE: tl.constexpr,
    PRECISE_EXP: tl.constexpr, CHUNKED: tl.constexpr, RING: tl.constexpr,
):
    # k, gate: [T, 128] bf16; pool_offsets: [B+1] int64 (pools completed before each request); table: [B, M] int
    # iq: [num_blocks, states / PAGE, PAGE, 128] uint8; is: [num_blocks, states / PAGE, PAGE] fp32 (kernel pages)
    # start: [B] int (CHUNKED only); ring: [num_rings, 2, RING, 128] bf16 (strides ring_stride, gate_half, slot_stride)
    pools = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = pools < tl.load(pool_offsets_ptr + num_requests)
    low = tl.zeros((BLOCK_P,), tl.int64)
    high = tl.zeros((BLOCK_P,), tl.int64) + num_requests
    for _ in range(search_steps):  # largest request r with pool_offsets[r] <= pool
        mid = (low + high) // 2
        below = tl.load(pool_offsets_ptr + mid, mask=live, other=0) <= pools
        low = tl.where(below, mid, low)
        high = tl.where(below, high, mid)
    request = low
    local = pools - tl.load(pool_offsets_ptr + request, mask=live, other=0)
    token0 = tl.load(qsl_ptr + request, mask=live, other=0).to(tl.int64)
    if CHUNKED:
        start = tl.load(start_ptr + request, mask=live, other=0).to(tl.int64)
        pool = start // KPOOL + local
        pos0 = pool * KPOOL
        row0 = (token0 + pos0 - start) * 128  # negative for the straddling pool's ring slots (masked there)
        ring_row0 = tl.maximum(tl.load(ring_ids_ptr + request, mask=live, other=0).to(tl.int64), 0) * ring_stride
        codes, scale = compress_tile(k_ptr, g_ptr, ape_ptr, ring_ptr, gate_half, row0, 128, pos0, start, ring_row0,
                                     RING, slot_stride, live, BLOCK_P, KPOOL, SOFTMAX, ROUND_SCALE, PRECISE_EXP, True)
    else:
        pool = local
        row0 = (token0 + local * KPOOL) * 128
        codes, scale = compress_tile(k_ptr, g_ptr, ape_ptr, k_ptr, 0, row0, 128, row0, 0, row0, 1, 0, live,
                                     BLOCK_P, KPOOL, SOFTMAX, ROUND_SCALE, PRECISE_EXP, False)
    column = pool * KPOOL // block_size
    block = tl.load(table_ptr + request * table_stride + column, mask=live & (column < table_width), other=-1)
    block = block.to(tl.int64)
    write = live & (block >= 0)
    q_at, scale_at = entry_offsets(block, pool % states, PAGE, iq_block, iq_page, iq_entry, is_block, is_page, is_entry)
    dims = tl.arange(0, 128)
    tl.store(iq_ptr + q_at[:, None] + dims[None, :], codes, mask=write[:, None])
    tl.store(is_ptr + scale_at, scale, mask=write)


@triton.jit
def _seed_ring_kernel(k_ptr, g_ptr, qsl_ptr, start_ptr, ring_ids_ptr, ring_ptr, ring_stride, gate_half, slot_stride,
                      ring_size, KPOOL: tl.constexpr, BLOCK_T: tl.constexpr):
    # ring: [num_rings, 2, R, 128] bf16 (strides ring_stride, gate_half, slot_stride, 1); one program per request
    request = tl.program_id(0)
    token0 = tl.load(qsl_ptr + request).to(tl.int64)
    first = tl.load(start_ptr + request).to(tl.int64)
    end = first + tl.load(qsl_ptr + request + 1).to(tl.int64) - token0
    ring_id = tl.load(ring_ids_ptr + request).to(tl.int64)
    positions = end // KPOOL * KPOOL + tl.arange(0, BLOCK_T)
    live = (positions >= first) & (positions < tl.where(ring_id >= 0, end, 0))
    dims = tl.arange(0, 128)
    src = (token0 + positions - first)[:, None] * 128 + dims[None, :]
    dst = ring_id * ring_stride + (positions % ring_size)[:, None] * slot_stride + dims[None, :]
    tl.store(ring_ptr + dst, tl.load(k_ptr + src, mask=live[:, None]), mask=live[:, None])
    tl.store(ring_ptr + gate_half + dst, tl.load(g_ptr + src, mask=live[:, None]), mask=live[:, None])


def prefill_compress_write_triton(
    k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, query_start_loc: torch.Tensor,
    start_pos: torch.Tensor | None, pool_offsets: torch.Tensor, block_table: torch.Tensor, ring_ids: torch.Tensor,
    tail_ring: torch.Tensor,
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, mode: PoolMode, round_scale: bool,
    block_p: int | None = None, num_warps: int = 4,
) -> None:
    """# k, gate: [T, 128] bf16; ape: [kpool, 128] fp32; query_start_loc: [B+1] int; start_pos: [B] int or None
    # (whole prompts); pool_offsets: [B+1] int64 (``prefill_pool_offsets``); block_table: [B, M] int; ring_ids: [B] int; tail_ring: [num_rings, 2, R, 128] bf16 (read)
    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages, states_per_page]
    #   fp32 (written in place)
    """
    kpool, page, batch = ape.shape[0], indexer_q.shape[2], query_start_loc.shape[0] - 1
    states = indexer_q.shape[1] * page
    chunked = start_pos is not None
    max_pools = (k.shape[0] + (kpool - 1) * batch if chunked else k.shape[0]) // kpool
    if max_pools == 0 or batch == 0:
        return
    assert k.stride() == (DIM, 1) and gate.stride() == (DIM, 1), "k and gate rows must be contiguous"
    assert block_table.stride(1) == 1, "table rows must be contiguous"
    assert tail_ring.stride(3) == 1, "ring rows must be contiguous"
    qsl = query_start_loc if query_start_loc.dtype == torch.int64 else query_start_loc.to(torch.int64)
    block_p = block_p or 8  # fastest of 8, 16, 32, 64 on the H200 (bench/results/2026-11-30-h200-kernels.txt)
    _prefill_compress_kernel[(triton.cdiv(max_pools, block_p),)](
        k, gate, ape.contiguous(), qsl, start_pos if chunked else qsl, pool_offsets, block_table, ring_ids, tail_ring,
        indexer_q.view(torch.uint8), indexer_scale,
        batch, max(batch - 1, 0).bit_length(), block_table.stride(0), block_table.shape[1], states, kpool * states,
        *page_strides(indexer_q, indexer_scale), tail_ring.stride(0), tail_ring.stride(1), tail_ring.stride(2),
        BLOCK_P=block_p, PAGE=page, KPOOL=kpool, SOFTMAX=mode is PoolMode.SOFTMAX, ROUND_SCALE=round_scale,
        PRECISE_EXP=not interpreting(), CHUNKED=chunked, RING=tail_ring.shape[2] if chunked else 1,
        num_warps=num_warps, **launch_options(),
    )


def seed_tail_ring_triton(k: torch.Tensor, gate: torch.Tensor, query_start_loc: torch.Tensor, start_pos: torch.Tensor,
                          ring_ids: torch.Tensor, tail_ring: torch.Tensor, *, kpool: int) -> None:
    """# k, gate: [T, 128] bf16; query_start_loc: [B+1] int; start_pos: [B] int; ring_ids: [B] int (-1 = skip)
    # tail_ring: [num_rings, 2, R, 128] bf16 (written in place)
    """
    batch = query_start_loc.shape[0] - 1
    if batch == 0:
        return
    assert tail_ring.stride(3) == 1, "ring rows must be contiguous"
    _seed_ring_kernel[(batch,)](
        k, gate, query_start_loc, start_pos, ring_ids, tail_ring, tail_ring.stride(0), tail_ring.stride(1), tail_ring.stride(2),
        tail_ring.shape[2],
        KPOOL=kpool, BLOCK_T=triton.next_power_of_2(kpool), num_warps=4,
    )
