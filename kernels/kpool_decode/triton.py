"""Triton decode step update: one launch for the whole batch and all of its draft tokens.

One program per request. It compresses, in position order, every pool that one of the step's
tokens completes, reading each pool slot from the step's own tokens (positions at or past
``start_pos``) or from the ring (earlier positions, written by earlier steps), and writes the entries;
and it stashes the step's tokens in the ring. Reading this step's slots from the input instead of the
ring gives the reference's values, since a pool spans fewer than R positions. When the step's tokens
cannot reach the ring slots of the older positions that the pools read (count <= R - kpool + 1, which
every step of at most num_spec drafts satisfies), the ring writes go first, with no barrier; otherwise
they go last, after a barrier, so every ring read sees the previous step's contents. Of more than R
tokens only the last R reach the ring, as in the reference's sequential overwrite.

No host synchronisation and no per-token launches: grid = (B,), loops run on device values, so the
launch can be captured in a CUDA graph. ``ring_ids`` must be valid ring indices: a request whose ring
id is negative is skipped (nothing written), where the reference would index the last ring.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpreting
from kernels.kpool_compress.triton import DIM, compress_tile, launch_options
from kvcache import PoolMode


@triton.jit
def _stash_tokens(k_ptr, g_ptr, ring_ptr, gate_half, slot_stride, ring_size, ring_row0, first_token, start, count, dims,
                  BLOCK_T: tl.constexpr):
    """Write the step's tokens (the last ring_size of them) to their ring slots."""
    for chunk in range(tl.maximum(count - ring_size, 0), count, BLOCK_T):
        tokens = chunk + tl.arange(0, BLOCK_T)
        live = tokens < count
        src = (first_token + tokens)[:, None] * 128 + dims[None, :]
        dst = ring_row0 + ((start + tokens) % ring_size)[:, None] * slot_stride + dims[None, :]
        tl.store(ring_ptr + dst, tl.load(k_ptr + src, mask=live[:, None]), mask=live[:, None])
        tl.store(ring_ptr + gate_half + dst, tl.load(g_ptr + src, mask=live[:, None]), mask=live[:, None])


@triton.jit
def _decode_update_kernel(
    k_ptr, g_ptr, start_pos_ptr, qsl_ptr, ring_ids_ptr, table_ptr, ape_ptr, ring_ptr, iq_ptr, is_ptr,
    table_stride, table_width, ring_stride, gate_half, slot_stride, ring_size, states, block_size,
    iq_block, iq_state, is_block, is_state,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, KPOOL: tl.constexpr, SOFTMAX: tl.constexpr,
    ROUND_SCALE: tl.constexpr, PRECISE_EXP: tl.constexpr,
):
    # k, gate: [T, 128] bf16; ring: [num_rings, 2, R, 128] bf16 (strides ring_stride, gate_half, slot_stride, 1)
    # table: [B, M] int
    request = tl.program_id(0)
    first_token = tl.load(qsl_ptr + request).to(tl.int64)
    end_token = tl.load(qsl_ptr + request + 1).to(tl.int64)
    start = tl.load(start_pos_ptr + request).to(tl.int64)
    ring_id = tl.load(ring_ids_ptr + request).to(tl.int64)
    count = tl.where(ring_id >= 0, end_token - first_token, 0)
    ring_row0 = ring_id * ring_stride
    dims = tl.arange(0, 128)
    first_pool = start // KPOOL
    completed = (start + count) // KPOOL - first_pool
    # The pools read positions from first_pool * KPOOL >= start - KPOOL + 1 on; the ring slots of the older ones
    # are rewritten by this step only when a token lies R or more positions after one of them, i.e. when
    # count > R - KPOOL + 1. Otherwise (every step with at most num_spec drafts, since R >= KPOOL + num_spec) the
    # ring writes go first, overlapping the compression, with no barrier.
    early = count <= ring_size - KPOOL + 1
    if early:
        _stash_tokens(k_ptr, g_ptr, ring_ptr, gate_half, slot_stride, ring_size, ring_row0, first_token, start, count,
                      dims, BLOCK_T)
    for chunk in range(0, completed, BLOCK_C):
        pools = first_pool + chunk + tl.arange(0, BLOCK_C)
        live = (chunk + tl.arange(0, BLOCK_C)) < completed
        pos0 = pools * KPOOL
        column = pos0 // block_size
        block = tl.load(table_ptr + request * table_stride + column, mask=live & (column < table_width), other=-1)
        row0 = (first_token + pos0 - start) * 128
        codes, scale = compress_tile(k_ptr, g_ptr, ape_ptr, ring_ptr, gate_half, row0, 128, pos0, start,
                                     ring_row0 + tl.zeros((BLOCK_C,), tl.int64), ring_size, slot_stride, live,
                                     BLOCK_C, KPOOL, SOFTMAX, ROUND_SCALE, PRECISE_EXP, True)
        block = block.to(tl.int64)
        write = live & (block >= 0)
        state = pools % states
        tl.store(iq_ptr + (block * iq_block + state * iq_state)[:, None] + dims[None, :], codes,
                 mask=write[:, None])
        tl.store(is_ptr + block * is_block + state * is_state, scale, mask=write)
    if not early:
        tl.debug_barrier()  # every ring read above precedes the ring writes below
        _stash_tokens(k_ptr, g_ptr, ring_ptr, gate_half, slot_stride, ring_size, ring_row0, first_token, start, count,
                      dims, BLOCK_T)


def decode_update_triton(
    k: torch.Tensor, gate: torch.Tensor, start_pos: torch.Tensor, query_start_loc: torch.Tensor,
    ring_ids: torch.Tensor, block_table: torch.Tensor, ape: torch.Tensor, tail_ring: torch.Tensor,
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, mode: PoolMode, round_scale: bool,
    block_c: int | None = None, num_warps: int = 4,
) -> None:
    """# k, gate: [T, 128] bf16; start_pos, ring_ids: [B] int; query_start_loc: [B+1] int; block_table: [B, M] int
    # ape: [kpool, 128] fp32; tail_ring: [num_rings, 2, R, 128] bf16
    # indexer_q: [num_blocks, S, 128] fp8; indexer_scale: [num_blocks, S] fp32 (all written in place)
    """
    kpool, ring_size, states = ape.shape[0], tail_ring.shape[2], indexer_q.shape[1]
    batch = query_start_loc.shape[0] - 1
    if batch == 0:
        return
    assert k.stride() == (DIM, 1) and gate.stride() == (DIM, 1), "k and gate rows must be contiguous"
    assert tail_ring.stride(3) == 1, "ring rows must be contiguous"
    assert indexer_q.stride(2) == 1 and block_table.stride(1) == 1, "page rows and table rows must be contiguous"
    _decode_update_kernel[(batch,)](
        k, gate, start_pos, query_start_loc, ring_ids, block_table, ape.contiguous(), tail_ring,
        indexer_q.view(torch.uint8), indexer_scale, block_table.stride(0), block_table.shape[1], tail_ring.stride(0),
        tail_ring.stride(1), tail_ring.stride(2), ring_size, states, kpool * states, indexer_q.stride(0), indexer_q.stride(1),
        indexer_scale.stride(0), indexer_scale.stride(1),
        BLOCK_C=block_c or triton.next_power_of_2(max(ring_size // kpool, 1)), BLOCK_T=triton.next_power_of_2(ring_size),
        KPOOL=kpool, SOFTMAX=mode is PoolMode.SOFTMAX, ROUND_SCALE=round_scale, PRECISE_EXP=not interpreting(),
        num_warps=num_warps, **launch_options(),
    )
