"""Triton prefill of a batch of chunks: compress + paged write of every pool a chunk completes, and the
tail ring left holding the open pool.

Compression runs one program per BLOCK_P consecutive pools of the whole batch (pools numbered
request after request), so one launch covers every request; a program finds each pool's request from
the batch's offsets itself (a prefix sum of the requests' pool counts, compared with its pools: one
round of loads, no table made by other launches). No host synchronisation: the grid is sized from
the token count (a batch of B chunks completes at most (T + (kpool - 1) * B) // kpool pools).
Whole prompts: the same launch seeds the rings (extra programs; no pool reads a ring). With chunk
starts (``start_pos``), a pool's positions below its chunk's start are read from the ring
(``compress_tile``'s FROM_RING); the ring is written by a second launch, after every read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpreting
from kernels.kpool_cache.triton import entry_offsets, page_strides
from kernels.kpool_compress.triton import DIM, compress_tile
from kernels.triton_helpers import launch_options
from kvcache import PoolMode


@triton.jit
def _requests_of(pools, qsl_ptr, start_ptr, num_requests, KPOOL: tl.constexpr, CHUNKED: tl.constexpr,
                 BLOCK_B: tl.constexpr):
    """Each pool's request and its index among the request's completed pools, and the batch's pool count, from
    the batch's offsets alone (no precomputed table): the requests are taken BLOCK_B at a time, their pool counts
    summed (a running prefix sum), and a pool's request is the number of requests whose pools all come before it.
    # pools: [BLOCK_P] int64 -> request, local: [BLOCK_P] int64; total: int64"""
    request = tl.zeros(pools.shape, tl.int64)
    first = tl.zeros(pools.shape, tl.int64)  # the pool number of the request's first pool
    carry = (num_requests * 0).to(tl.int64)
    for chunk in range(0, num_requests, BLOCK_B):
        b = chunk + tl.arange(0, BLOCK_B)
        present = b < num_requests
        q0 = tl.load(qsl_ptr + b, mask=present, other=0).to(tl.int64)
        q1 = tl.load(qsl_ptr + b + 1, mask=present, other=0).to(tl.int64)
        if CHUNKED:
            s = tl.load(start_ptr + b, mask=present, other=0).to(tl.int64)
            count = (s + q1 - q0) // KPOOL - s // KPOOL
        else:
            count = (q1 - q0) // KPOOL
        ends = carry + tl.cumsum(count, axis=0)  # [BLOCK_B] pools up to and including request b
        before = (ends[None, :] <= pools[:, None]) & present[None, :]
        request += tl.sum(before.to(tl.int64), axis=1)
        first = tl.maximum(first, tl.max(tl.where(before, ends[None, :], 0), axis=1))
        carry += tl.sum(count, axis=0)
    return request, pools - first, carry


@triton.jit
def _prefill_compress_kernel(
    k_ptr, g_ptr, ape_ptr, qsl_ptr, start_ptr, table_ptr, ring_ids_ptr, ring_ptr, iq_ptr, is_ptr,
    num_requests, pool_tiles, table_stride, table_width, states, block_size, iq_block, iq_page, iq_entry, is_block,
    is_page, is_entry, ring_stride, gate_half, slot_stride,
    BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr, PAGE: tl.constexpr, KPOOL: tl.constexpr, SOFTMAX: tl.constexpr,
    ROUND_SCALE: tl.constexpr, PRECISE_EXP: tl.constexpr, CHUNKED: tl.constexpr, RING: tl.constexpr,
    SEED: tl.constexpr, SEED_R: tl.constexpr, SEED_T: tl.constexpr,
):
    # k, gate: [T, 128] bf16; qsl: [B+1] int; table: [B, M] int
    # iq: [num_blocks, states / PAGE, PAGE, 128] uint8; is: [num_blocks, states / PAGE, PAGE] fp32 (kernel pages)
    # start: [B] int (CHUNKED only); ring: [num_rings, 2, RING, 128] bf16 (strides ring_stride, gate_half, slot_stride)
    # programs [0, pool_tiles): BLOCK_P pools each; with SEED (whole prompts only: no pool reads the ring), programs
    # from pool_tiles on: the ring seeding of SEED_R requests each (``seed_rows``)
    tile = tl.program_id(0)
    if SEED:
        if tile >= pool_tiles:
            seed_rows(k_ptr, g_ptr, qsl_ptr, ring_ids_ptr, ring_ptr, ring_stride, gate_half, slot_stride,
                      (tile - pool_tiles).to(tl.int64) * SEED_R + tl.arange(0, SEED_R), num_requests, KPOOL, RING,
                      SEED_T)
            return
    pools = tile.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    request, local, total = _requests_of(pools, qsl_ptr, start_ptr, num_requests, KPOOL, CHUNKED, BLOCK_B)
    live = pools < total
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
def seed_rows(k_ptr, g_ptr, qsl_ptr, ring_ids_ptr, ring_ptr, ring_stride, gate_half, slot_stride, requests, num_requests,
              KPOOL: tl.constexpr, RING: tl.constexpr, SEED_T: tl.constexpr):
    """Whole prompts: write each request's open pool (positions [end // KPOOL * KPOOL, end)) to its ring.
    # requests: [N] int64; ring: [num_rings, 2, RING, 128] bf16 (strides ring_stride, gate_half, slot_stride, 1)"""
    present = requests < num_requests
    token0 = tl.load(qsl_ptr + requests, mask=present, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + requests + 1, mask=present, other=0).to(tl.int64) - token0
    ring_id = tl.load(ring_ids_ptr + requests, mask=present, other=-1).to(tl.int64)
    slots = tl.arange(0, SEED_T)[None, :, None]  # SEED_T: KPOOL rounded up to a power of two
    positions = (end // KPOOL * KPOOL)[:, None, None] + slots
    live = (present & (ring_id >= 0))[:, None, None] & (positions < end[:, None, None])
    dims = tl.arange(0, 128)[None, None, :]
    src = (token0[:, None, None] + positions) * 128 + dims
    dst = (ring_id * ring_stride)[:, None, None] + (positions % RING) * slot_stride + dims
    tl.store(ring_ptr + dst, tl.load(k_ptr + src, mask=live), mask=live)
    tl.store(ring_ptr + gate_half + dst, tl.load(g_ptr + src, mask=live), mask=live)


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
    start_pos: torch.Tensor | None, block_table: torch.Tensor, ring_ids: torch.Tensor, tail_ring: torch.Tensor,
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, mode: PoolMode, round_scale: bool,
    block_p: int | None = None, num_warps: int | None = None, seed: bool = False,
) -> None:
    """One launch, no host synchronisation and no other device work (a CUDA graph holds the one kernel). ``seed``
    (whole prompts only, ``start_pos`` None): the same launch also leaves each request's open pool in its ring
    (``seed_tail_ring_triton``'s work; no pool of a whole prompt reads the ring, so the order does not matter).

    # k, gate: [T, 128] bf16; ape: [kpool, 128] fp32; query_start_loc: [B+1] int; start_pos: [B] int or None
    # (whole prompts); block_table: [B, M] int; ring_ids: [B] int; tail_ring: [num_rings, 2, R, 128] bf16 (read;
    #   written with ``seed``); indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale:
    #   [num_blocks, pages, states_per_page] fp32 (written in place)
    """
    kpool, page, batch = ape.shape[0], indexer_q.shape[2], query_start_loc.shape[0] - 1
    states = indexer_q.shape[1] * page
    chunked = start_pos is not None
    assert not (seed and chunked), "a chunk's ring is seeded after its pools are read (seed_tail_ring_triton)"
    max_pools = (k.shape[0] + (kpool - 1) * batch if chunked else k.shape[0]) // kpool
    if batch == 0 or (max_pools == 0 and not seed):
        return
    assert k.stride() == (DIM, 1) and gate.stride() == (DIM, 1), "k and gate rows must be contiguous"
    assert block_table.stride(1) == 1, "table rows must be contiguous"
    assert tail_ring.stride(3) == 1, "ring rows must be contiguous"
    default_p, default_warps = default_launch(k.device)
    block_p, num_warps = block_p or default_p, num_warps or default_warps
    pool_tiles = triton.cdiv(max_pools, block_p)
    seed_r = num_warps  # requests a seeding program takes: one a warp
    seed_programs = triton.cdiv(batch, seed_r) if seed else 0
    _prefill_compress_kernel[(pool_tiles + seed_programs,)](
        k, gate, ape.contiguous(), query_start_loc, start_pos if chunked else query_start_loc, block_table, ring_ids,
        tail_ring, indexer_q.view(torch.uint8), indexer_scale,
        batch, pool_tiles, block_table.stride(0), block_table.shape[1], states, kpool * states,
        *page_strides(indexer_q, indexer_scale), tail_ring.stride(0), tail_ring.stride(1), tail_ring.stride(2),
        BLOCK_P=block_p, BLOCK_B=min(max(triton.next_power_of_2(batch), 16), MAX_BLOCK_B), PAGE=page, KPOOL=kpool,
        SOFTMAX=mode is PoolMode.SOFTMAX, ROUND_SCALE=round_scale, PRECISE_EXP=not interpreting(), CHUNKED=chunked,
        RING=tail_ring.shape[2], SEED=seed, SEED_R=seed_r, SEED_T=triton.next_power_of_2(kpool),
        num_warps=num_warps, **launch_options(),
    )


def default_launch(device: torch.device) -> tuple[int, int]:
    """(pools a program, warps a program) of the prefill compression."""
    if device.type != "cuda":
        return 8, 4
    return DEFAULT_BLOCK_P, DEFAULT_WARPS


DEFAULT_BLOCK_P = 8
DEFAULT_WARPS = 4
MAX_BLOCK_B = 256  # requests a program takes at a time while finding its pools' requests


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
