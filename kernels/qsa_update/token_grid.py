"""The forward update's compression over a grid of (tokens, heads): ``CompressGrid.TOKENS`` (see ``launch.py``).

A token whose ``compressed_slot_mapping`` names a row of the cache completes the group of the r positions
ending at its own; the metadata marks exactly the groups that ``k_work`` lists (a padding token has slot -1),
so the rows written are the ``WORK`` grid's, with the same arithmetic (``norm_rope_paired``). The loads, in
dependent rounds:

1. by the token index alone: its slot, request, position and ring slot; the requests of the r tokens ending at
   it and their keys (as if the group lay inside the chunk); the first of them's MRoPE position; the norm weight;
2. slot i of the group is inside the chunk when token ``t - (r - 1) + i`` belongs to the same request (tokens of
   a request are consecutive); the others come from the ring, read now with the first position's packed words
   (``cache_rope_positions``); cos/sin of a group inside the chunk read from the table;
3. cos/sin of a straddling group.

A straddling group's ring is ``ring_slot // C`` where the token has a ring slot (every token of a chunk of at
most C tokens), else ``ring_blocks[request]`` (one round more).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.qsa_compress.triton import norm_rope_paired, rope_cos_sin
from kernels.qsa_ring.triton import ring_position
from kernels.triton_helpers import (bf16_bits_to_f32, f32_to_bf16_bits, f32_to_e4m3_bits, gdc_launch_dependents,
                                    gdc_wait, round_to_bf16)


@triton.jit
def _mean_of_slots(bits, ROWS: tl.constexpr, R: tl.constexpr, R_P2: tl.constexpr, D_P2: tl.constexpr):
    """bf16-rounded mean of the R slots, added in slot order as the reference does, as fp32.
    # bits: [ROWS, R_P2, D_P2] int16 (bf16 bit patterns) -> [ROWS, D_P2] fp32"""
    slot = tl.arange(0, R_P2)
    wide = bits.to(tl.int32)
    total = tl.zeros((ROWS, D_P2), tl.float32)
    for i in tl.static_range(R):
        picked = tl.sum(tl.where((slot == i)[None, :, None], wide, 0), axis=1)  # integer: exact
        value = bf16_bits_to_f32(picked)
        if i == 0:
            total = value
        else:
            total = total + value
    return round_to_bf16(tl.math.div_rn(total, tl.full((ROWS, D_P2), R, tl.float32)))


@triton.jit
def compress_by_token_kernel(
    keys_ptr, pos_ptr, tok_req_ptr, tok_pos_ptr, ring_slot_ptr, comp_slot_ptr, rings_ptr, ring_ptr, comp_ptr, w_ptr,
    inv_freq_ptr, table_ptr, table_rows, tokens, key_tok_stride, key_head_stride, ring_stride, slot_stride,
    ring_head_stride, comp_block_stride, comp_row_stride, comp_head_stride, total_rows, eps,
    ROWS_PER_BLOCK: tl.constexpr, CAP: tl.constexpr, R: tl.constexpr, R_P2: tl.constexpr, D: tl.constexpr,
    D_P2: tl.constexpr, LOG_D: tl.constexpr, ROT: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    OFF: tl.constexpr, ROPE_CACHED: tl.constexpr, FP8: tl.constexpr, BLOCK_T: tl.constexpr, PRECISE: tl.constexpr,
    TABLE: tl.constexpr, PDL: tl.constexpr,
):
    # keys: [T, H, D] int16; positions: [T, 3] int64; token_to_req: [T] int32; logical_positions, ring slots,
    # compressed slots: [T] int64; ring_blocks: [B] int32; ring: [N, C, H, W] int16
    # compressed: [num_blocks, ROWS, H, D] int16 | uint8 (strides comp_*, dims contiguous); w: [D] fp32
    # table: [table_rows, ROT] fp32 (the RopeCache, with TABLE); grid: (cdiv(T, BLOCK_T), H)
    if PDL:  # launched before the previous kernel ends: wait for its writes; let the ring write launch early
        gdc_wait()
        gdc_launch_dependents()
    h = tl.program_id(1).to(tl.int64)
    last = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] the group's last token
    in_batch = last < tokens
    safe_last = tl.where(in_batch, last, 0)
    cols = tl.arange(0, D_P2)
    col_ok = cols < D
    i = tl.arange(0, R_P2)

    # Round 1: what the token index alone locates.
    slot = tl.load(comp_slot_ptr + safe_last, mask=in_batch, other=-1)
    req = tl.load(tok_req_ptr + safe_last, mask=in_batch, other=-1)
    pos = tl.load(tok_pos_ptr + safe_last, mask=in_batch, other=0)
    ring_slot = tl.load(ring_slot_ptr + safe_last, mask=in_batch, other=-1)
    tok = last[:, None] + (i - (R - 1))[None, :]  # [BLOCK_T, R_P2] the group's tokens, were it inside the chunk
    tok_ok = in_batch[:, None] & (tok >= 0) & (i < R)[None, :]
    safe_tok = tl.where(tok_ok, tok, 0)
    tok_req = tl.load(tok_req_ptr + safe_tok, mask=tok_ok, other=-1)
    key_at = safe_tok * key_tok_stride + h * key_head_stride
    chunk_bits = tl.load(keys_ptr + key_at[:, :, None] + cols[None, None, :],
                         mask=tok_ok[:, :, None] & col_ok[None, None, :], other=0)
    tok0 = last - (R - 1)
    first_ok = in_batch & (tok0 >= 0)
    safe_tok0 = tl.where(first_ok, tok0, 0)
    req0 = tl.load(tok_req_ptr + safe_tok0, mask=first_ok, other=-1)
    first_t = tl.load(pos_ptr + safe_tok0 * 3, mask=first_ok, other=0)
    first_h = tl.load(pos_ptr + safe_tok0 * 3 + 1, mask=first_ok, other=0)
    first_w = tl.load(pos_ptr + safe_tok0 * 3 + 2, mask=first_ok, other=0)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)

    write = in_batch & (slot >= 0) & (slot < total_rows)
    if tl.max(write.to(tl.int32), axis=0) > 0:
        # Round 2: the ring's part of a straddling group (slots whose token is another request's or none).
        pos0 = pos - (R - 1)  # the group's first position (>= 0: the token completes a group)
        old = write[:, None] & (tok_req != req[:, None]) & (i < R)[None, :]
        old_first = write & (req0 != req)
        any_old = tl.max(old.to(tl.int32), axis=1) > 0
        has_ring_slot = ring_slot >= 0
        listed = tl.load(rings_ptr + tl.where(write, req, 0), mask=write & any_old & ~has_ring_slot, other=0)
        ring_id = tl.where(has_ring_slot, ring_slot // CAP, listed.to(tl.int64))
        ring_row0 = ring_id * ring_stride
        ring_at = ring_row0[:, None] + h * ring_head_stride + ((pos0[:, None] + i[None, :]) % CAP) * slot_stride
        ring_bits = tl.load(ring_ptr + ring_at[:, :, None] + cols[None, None, :],
                            mask=old[:, :, None] & col_ok[None, None, :], other=0)
        if ROPE_CACHED:
            packed = tl.where(old_first, ring_row0 + (pos0 % CAP) * slot_stride + OFF, 0)
            first_t = tl.where(old_first, ring_position(ring_ptr, packed, 0, old_first), first_t)
            first_h = tl.where(old_first, ring_position(ring_ptr, packed, 1, old_first), first_h)
            first_w = tl.where(old_first, ring_position(ring_ptr, packed, 2, old_first), first_w)
        else:
            first_t = tl.where(old_first, pos0, first_t)
            first_h = tl.where(old_first, pos0, first_h)
            first_w = tl.where(old_first, pos0, first_w)
        cos, sin = rope_cos_sin(inv_freq_ptr, table_ptr, table_rows, first_t, first_h, first_w, BLOCK_T, D_P2, ROT,
                                S1, S2, True, PRECISE, TABLE)
        x = _mean_of_slots(tl.where(old[:, :, None], ring_bits, chunk_bits), BLOCK_T, R, R_P2, D_P2)
        y = norm_rope_paired(x, w, cos, sin, eps, BLOCK_T, D, D_P2, LOG_D, ROT)
        row_base = (slot // ROWS_PER_BLOCK) * comp_block_stride + (slot % ROWS_PER_BLOCK) * comp_row_stride
        out = comp_ptr + (row_base + h * comp_head_stride)[:, None] + cols[None, :]
        mask = write[:, None] & col_ok[None, :]
        if FP8:
            tl.store(out, f32_to_e4m3_bits(y), mask=mask)
        else:
            tl.store(out, f32_to_bf16_bits(y), mask=mask)


def token_grid(tokens: int, heads: int, block: int) -> tuple[int, int]:
    """The (tokens, heads) grid of ``compress_by_token_kernel``."""
    return triton.cdiv(tokens, block), heads
