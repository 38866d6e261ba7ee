"""Triton decode step update: one launch for the whole batch and all of its draft tokens.

Each program takes BLOCK_R requests side by side (a [BLOCK_R, 128] tile: one row per request). It
compresses, in position order, every pool that one of the step's tokens completes (the j-th pool of
every request in the program at once), reading each pool slot from the step's own tokens (positions
at or past ``start_pos``) or from the ring (earlier positions, written by earlier steps), and writes
the entries; then it stashes the step's tokens in the ring. Reading this step's slots from the input
instead of the ring gives the reference's values, since a pool spans fewer than R positions. Of more
than R tokens only the last R reach the ring, as in the reference's sequential overwrite.

The kernel is latency-bound (every program runs in one wave), so the code keeps the dependent chain
short: every per-request scalar is loaded at once as a [BLOCK_R] vector; the step's tokens are loaded
before the pool's slots, so both sets of loads are in flight together, and stored to the ring after
the entries (the pool-completing token's work is not behind the stash); the first pool is
straight-line code, only further pools loop; positions are int32 and the ring size, kpool, states
per block and states per kernel page are compile-time constants, so every division and modulo is a
multiply and shift (no 64-bit division routine); offsets are widened to int64 only when they become
addresses. The ring writes need a barrier after the ring reads only when a request's tokens can reach
the slots its pools read (count > R - kpool + 1, which no step of at most num_spec drafts does); the
program takes it only then.

No host synchronisation and no per-token launches: grid = (cdiv(B, BLOCK_R),), loops run on device
values, so the launch can be captured in a CUDA graph. ``ring_ids`` must be valid ring indices: a
request whose ring id is negative is skipped (nothing written), where the reference would index the
last ring. Positions and token counts must stay below 2**31 - R (int32 arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.dispatch import interpreting
from kpool_pd.kernels.kpool_cache.triton import entry_offsets, page_strides
from kpool_pd.kernels.kpool_compress.triton import DIM, compress_tile
from kpool_pd.kernels.triton_helpers import gdc_launch_dependents, gdc_wait, launch_options, pdl_available
from kpool_pd.kvcache import PoolMode


@triton.jit
def _stash_chunks(k_ptr, g_ptr, ring_ptr, gate_half, slot_stride, ring_row0, first_token, start, count, wanted,
                  max_count, RING: tl.constexpr, BLOCK_T: tl.constexpr):
    """Write each wanted request's tokens (the last RING of them) to their ring slots, BLOCK_T at a time.

    # ring_row0, first_token: [BLOCK_R] int64; start, count: [BLOCK_R] int32; wanted: [BLOCK_R] bool
    """
    dims = tl.arange(0, 128)[None, None, :]
    lowest = tl.maximum(count - RING, 0)[:, None, None]
    for chunk in range(0, max_count, BLOCK_T):
        tokens = chunk + tl.arange(0, BLOCK_T)[None, :, None]  # [1, BLOCK_T, 1]
        live = wanted[:, None, None] & (tokens >= lowest) & (tokens < count[:, None, None])
        src = (first_token[:, None, None] + tokens) * 128 + dims
        slot = ((start[:, None, None] + tokens) % RING).to(tl.int64)
        dst = ring_row0[:, None, None] + slot * slot_stride + dims
        tl.store(ring_ptr + dst, tl.load(k_ptr + src, mask=live), mask=live)
        tl.store(ring_ptr + gate_half + dst, tl.load(g_ptr + src, mask=live), mask=live)


@triton.jit
def _compress_and_write(j, completed, first_pool, start, first_token, ring_row0, table_row, k_ptr, g_ptr, ape_ptr,
                        ring_ptr, table_ptr, slot_ptr, iq_ptr, is_ptr, table_width, gate_half, slot_stride, iq_block,
                        iq_page, iq_entry, is_block, is_page, is_entry, BLOCK_R: tl.constexpr, KPOOL: tl.constexpr,
                        RING: tl.constexpr, STATES: tl.constexpr, PAGE: tl.constexpr, SOFTMAX: tl.constexpr,
                        ROUND_SCALE: tl.constexpr, PRECISE_EXP: tl.constexpr, SLOT_MAPPED: tl.constexpr):
    """Compress the j-th pool that each request's step completes and write its entry (skipped where the block
    table holds -1). With SLOT_MAPPED the entry's slot is the metadata's, read at the token that closes the pool
    (-1 skips); else it is located from the block table. # -> nothing; first_pool, start, completed: [BLOCK_R] int32"""
    live = j < completed
    pool = first_pool + j
    pos0 = pool * KPOOL
    if SLOT_MAPPED:
        closing = first_token + (pos0 + KPOOL - 1 - start)
        mapped = tl.load(slot_ptr + closing, mask=live, other=-1).to(tl.int64)
        block = tl.where(mapped >= 0, mapped // STATES, -1)
    else:
        column = pool // STATES
        block = tl.load(table_ptr + table_row + column, mask=live & (column < table_width), other=-1).to(tl.int64)
    row0 = (first_token + (pos0 - start)) * 128
    codes, scale = compress_tile(k_ptr, g_ptr, ape_ptr, ring_ptr, gate_half, row0, 128, pos0, start, ring_row0,
                                 RING, slot_stride, live, BLOCK_R, KPOOL, SOFTMAX, ROUND_SCALE, PRECISE_EXP, True)
    write = live & (block >= 0)
    if SLOT_MAPPED:
        state = tl.where(mapped >= 0, mapped % STATES, 0)
    else:
        state = (pool % STATES).to(tl.int64)
    q_at, scale_at = entry_offsets(block, state, PAGE, iq_block, iq_page, iq_entry, is_block, is_page, is_entry)
    dims = tl.arange(0, 128)
    tl.store(iq_ptr + q_at[:, None] + dims[None, :], codes, mask=write[:, None])
    tl.store(is_ptr + scale_at, scale, mask=write)


@triton.jit
def _decode_update_kernel(
    k_ptr, g_ptr, start_pos_ptr, qsl_ptr, ring_ids_ptr, table_ptr, slot_ptr, ape_ptr, ring_ptr, iq_ptr, is_ptr,
    batch, table_stride, table_width, ring_stride, gate_half, slot_stride, iq_block, iq_page, iq_entry, is_block,
    is_page, is_entry, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, KPOOL: tl.constexpr, RING: tl.constexpr,
    STATES: tl.constexpr, PAGE: tl.constexpr, SOFTMAX: tl.constexpr, ROUND_SCALE: tl.constexpr,
    PRECISE_EXP: tl.constexpr, PDL: tl.constexpr, SLOT_MAPPED: tl.constexpr,
):
    # k, gate: [T, 128] bf16; ring: [num_rings, 2, RING, 128] bf16 (strides ring_stride, gate_half, slot_stride, 1)
    # table: [B, M] int; indexer q: [num_blocks, STATES / PAGE, PAGE, 128] uint8, scale: [num_blocks, STATES / PAGE,
    # PAGE] fp32 (kernel pages of PAGE states)
    if PDL:  # launched before the previous kernel ends: wait for its writes, let the next kernel launch early
        gdc_wait()
        gdc_launch_dependents()
    requests = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    present = requests < batch
    first_token32 = tl.load(qsl_ptr + requests, mask=present, other=0).to(tl.int32)
    end_token = tl.load(qsl_ptr + requests + 1, mask=present, other=0).to(tl.int32)
    start = tl.load(start_pos_ptr + requests, mask=present, other=0).to(tl.int32)
    ring_id = tl.load(ring_ids_ptr + requests, mask=present, other=-1).to(tl.int64)
    count = tl.where(ring_id >= 0, end_token - first_token32, 0)
    ring_row0 = ring_id * ring_stride
    first_token = first_token32.to(tl.int64)
    table_row = requests.to(tl.int64) * table_stride
    first_pool = start // KPOOL
    completed = (start + count) // KPOOL - first_pool

    # The step's tokens, when a request has at most BLOCK_T (>= RING) of them: loaded now, so that these loads and
    # the pool's overlap, and stored last, after every ring read of the program.
    tokens = tl.arange(0, BLOCK_T)[None, :, None]
    dims3 = tl.arange(0, 128)[None, None, :]
    short = count <= BLOCK_T
    stash = (short[:, None, None] & (tokens >= tl.maximum(count - RING, 0)[:, None, None])
             & (tokens < count[:, None, None]))
    src = (first_token[:, None, None] + tokens) * 128 + dims3
    stash_k = tl.load(k_ptr + src, mask=stash)
    stash_g = tl.load(g_ptr + src, mask=stash)

    most = tl.max(completed, axis=0)
    if most > 0:  # the first pool of each request: straight-line code, its loads issued with the stash's
        _compress_and_write(0, completed, first_pool, start, first_token, ring_row0, table_row, k_ptr, g_ptr, ape_ptr,
                            ring_ptr, table_ptr, slot_ptr, iq_ptr, is_ptr, table_width, gate_half, slot_stride,
                            iq_block, iq_page, iq_entry, is_block, is_page, is_entry, BLOCK_R, KPOOL, RING, STATES,
                            PAGE, SOFTMAX, ROUND_SCALE, PRECISE_EXP, SLOT_MAPPED)
    for j in range(1, most):  # steps that complete several pools (more tokens than kpool)
        _compress_and_write(j, completed, first_pool, start, first_token, ring_row0, table_row, k_ptr, g_ptr, ape_ptr,
                            ring_ptr, table_ptr, slot_ptr, iq_ptr, is_ptr, table_width, gate_half, slot_stride,
                            iq_block, iq_page, iq_entry, is_block, is_page, is_entry, BLOCK_R, KPOOL, RING, STATES,
                            PAGE, SOFTMAX, ROUND_SCALE, PRECISE_EXP, SLOT_MAPPED)

    # A request's pools read positions from first_pool * KPOOL >= start - KPOOL + 1 on; the ring slots of the older
    # ones are rewritten by this step only when a token lies RING or more positions after one of them, i.e. when
    # count > RING - KPOOL + 1. Otherwise (every step with at most num_spec drafts, since RING >= KPOOL + num_spec)
    # no thread's ring write can meet another thread's ring read, and no barrier is needed.
    late = count > RING - KPOOL + 1
    if tl.max(late.to(tl.int32), axis=0) > 0:
        tl.debug_barrier()  # every ring read above precedes the ring writes below
    slot = ((start[:, None, None] + tokens) % RING).to(tl.int64)
    dst = ring_row0[:, None, None] + slot * slot_stride + dims3
    tl.store(ring_ptr + dst, stash_k, mask=stash)
    tl.store(ring_ptr + gate_half + dst, stash_g, mask=stash)
    longest = tl.max(count, axis=0)
    if longest > BLOCK_T:  # more tokens than the ring holds: the last RING of them, a chunk at a time
        _stash_chunks(k_ptr, g_ptr, ring_ptr, gate_half, slot_stride, ring_row0, first_token, start, count, ~short,
                      longest, RING, BLOCK_T)


def decode_update_triton(
    k: torch.Tensor, gate: torch.Tensor, start_pos: torch.Tensor, query_start_loc: torch.Tensor,
    ring_ids: torch.Tensor, block_table: torch.Tensor, ape: torch.Tensor, tail_ring: torch.Tensor,
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, mode: PoolMode, round_scale: bool,
    block_r: int | None = None, num_warps: int | None = None, pdl: bool | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """# k, gate: [T, 128] bf16; start_pos, ring_ids: [B] int; query_start_loc: [B+1] int; block_table: [B, M] int
    # slot_mapping: [T] int64 or None, the pool-granular slots of ``KpoolMetadata`` (None: from the block table)
    # ape: [kpool, 128] fp32; tail_ring: [num_rings, 2, R, 128] bf16
    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages, states_per_page]
    #   fp32 (all written in place)
    """
    kpool, ring_size, page = ape.shape[0], tail_ring.shape[2], indexer_q.shape[2]
    states = indexer_q.shape[1] * page
    batch = query_start_loc.shape[0] - 1
    if batch == 0:
        return
    assert k.stride() == (DIM, 1) and gate.stride() == (DIM, 1), "k and gate rows must be contiguous"
    assert tail_ring.stride(3) == 1, "ring rows must be contiguous"
    assert block_table.stride(1) == 1, "table rows must be contiguous"
    block_r = block_r or DEFAULT_BLOCK_R
    pdl = (DEFAULT_PDL if pdl is None else pdl) and k.is_cuda and pdl_available()
    extra = {"launch_pdl": True} if pdl else {}
    _decode_update_kernel[(triton.cdiv(batch, block_r),)](
        k, gate, start_pos, query_start_loc, ring_ids, block_table,
        block_table if slot_mapping is None else slot_mapping, ape.contiguous(), tail_ring,
        indexer_q.view(torch.uint8), indexer_scale, batch, block_table.stride(0), block_table.shape[1],
        tail_ring.stride(0), tail_ring.stride(1), tail_ring.stride(2), *page_strides(indexer_q, indexer_scale),
        BLOCK_R=block_r, BLOCK_T=triton.next_power_of_2(ring_size), KPOOL=kpool, RING=ring_size, STATES=states,
        PAGE=page,
        SOFTMAX=mode is PoolMode.SOFTMAX, ROUND_SCALE=round_scale, PRECISE_EXP=not interpreting(), PDL=pdl,
        SLOT_MAPPED=slot_mapping is not None,
        num_warps=num_warps or _default_warps(k.device, triton.cdiv(batch, block_r)), **launch_options(), **extra,
    )


def _default_warps(device: torch.device, programs: int) -> int:
    """4 warps a program while the grid fits one wave of those (4 programs an SM), else 1: measured on the H200
    (bench/results/2026-12-01-h200-kernels.txt), 256 x 4 tokens 2.71 us a call with 4 warps against 3.24 with 1;
    1,024 x 4 tokens 4.03 us with 1 warp against 4.55 with 4 (32 calls in one graph, without PDL)."""
    if device.type != "cuda":
        return 4
    return 4 if programs <= 4 * torch.cuda.get_device_properties(device).multi_processor_count else 1


DEFAULT_BLOCK_R = 1  # requests a program: 1 was fastest of 1, 2, 4, 8 on the H200 at every batch measured
DEFAULT_PDL = True  # programmatic dependent launch: overlaps this launch with the previous kernel's tail
