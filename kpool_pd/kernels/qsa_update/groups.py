"""The per-group step of the Triton forward update that both of its grids share (``triton.py``'s work items,
``per_request.py``'s requests): a tile of groups compressed, slot by slot from this forward's keys or, for
positions before the chunk, from the request's ring; the group's first MRoPE position from ``positions``, the
ring's packed positions, or ``(p, p, p)``; its cos/sin from the ``RopeCache`` where one is given and holds the
position, else computed; the row written to the slot that the group's last token carries in
``compressed_slot_mapping`` (a slot of -1 or past the cache is skipped). It reads the ring and never writes it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kpool_pd.kernels.qsa_compress.triton import compress_tile, rope_cos_sin
from kpool_pd.kernels.triton_helpers import f32_to_bf16_bits, f32_to_e4m3_bits


@triton.jit
def _ring_position(ring_ptr, row, axis: tl.constexpr, live):
    """int64 MRoPE position ``axis`` packed at ring element offset ``row`` (4 int16 words, little end first)."""
    value = tl.zeros(row.shape, tl.int64)
    for k in tl.static_range(4):
        word = tl.load(ring_ptr + row + axis * 4 + k, mask=live, other=0)
        value = value | ((word.to(tl.int64) & 0xFFFF) << (16 * k))
    return value


@triton.jit
def compress_groups(
    keys_ptr, pos_ptr, ring_ptr, comp_slot_ptr, comp_ptr, w_ptr, inv_freq_ptr, table_ptr, table_rows, q0, start,
    ring_row0, index, live, heads, key_tok_stride, key_head_stride, slot_stride, ring_head_stride, comp_block_stride,
    comp_row_stride, comp_head_stride, total_rows, eps,
    ROWS_PER_BLOCK: tl.constexpr, CAP: tl.constexpr, R: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
    LOG_D: tl.constexpr, ROT: tl.constexpr, PAIRED: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    OFF: tl.constexpr, ROPE_CACHED: tl.constexpr, FP8: tl.constexpr, BLOCK_W: tl.constexpr, PRECISE: tl.constexpr,
    TABLE: tl.constexpr,
):
    """Compress BLOCK_W groups where ``live`` and write each to its compressed row: group ``index`` of the chunk
    of a request whose tokens start at ``q0`` in this forward and at position ``start``, with its ring at element
    ``ring_row0`` (int16 view). Reads the ring, never writes it.

    # q0, start, ring_row0: [BLOCK_W] or scalar int64; index: [BLOCK_W] int64; live: [BLOCK_W] bool
    """
    pos0 = (start // R + index) * R  # the group's first position
    tok0 = q0 + pos0 - start  # its token index in this forward (below q0 when it straddles)

    fresh = live & (pos0 >= start)
    safe_tok = tl.where(fresh, tok0, 0)
    first_t = tl.load(pos_ptr + safe_tok * 3, mask=fresh, other=0)
    first_h = tl.load(pos_ptr + safe_tok * 3 + 1, mask=fresh, other=0)
    first_w = tl.load(pos_ptr + safe_tok * 3 + 2, mask=fresh, other=0)
    old = live & (pos0 < start)
    if ROPE_CACHED:
        packed = tl.where(old, ring_row0 + (pos0 % CAP) * slot_stride + OFF, 0)
        first_t = tl.where(old, _ring_position(ring_ptr, packed, 0, old), first_t)
        first_h = tl.where(old, _ring_position(ring_ptr, packed, 1, old), first_h)
        first_w = tl.where(old, _ring_position(ring_ptr, packed, 2, old), first_w)
    else:
        first_t = tl.where(old, pos0, first_t)
        first_h = tl.where(old, pos0, first_h)
        first_w = tl.where(old, pos0, first_w)

    slot = tl.load(comp_slot_ptr + tl.where(live, tok0 + R - 1, 0), mask=live, other=-1)
    write = live & (slot >= 0) & (slot < total_rows)
    row_base = (slot // ROWS_PER_BLOCK) * comp_block_stride + (slot % ROWS_PER_BLOCK) * comp_row_stride
    cols = tl.arange(0, D_P2)
    mask = write[:, None] & (cols < D)[None, :]
    cos, sin = rope_cos_sin(inv_freq_ptr, table_ptr, table_rows, first_t, first_h, first_w, BLOCK_W, D_P2, ROT, S1, S2,
                            PAIRED, PRECISE, TABLE)
    for h in range(heads):
        y = compress_tile(keys_ptr, ring_ptr, w_ptr, tok0 * key_tok_stride + h * key_head_stride, key_tok_stride,
                          ring_row0 + h * ring_head_stride, slot_stride, pos0, start, CAP, cos, sin, live, eps,
                          BLOCK_W, R, D, D_P2, LOG_D, ROT, PAIRED, True)
        out = comp_ptr + (row_base + h * comp_head_stride)[:, None] + cols[None, :]
        if FP8:
            tl.store(out, f32_to_e4m3_bits(y), mask=mask)
        else:
            tl.store(out, f32_to_bf16_bits(y), mask=mask)
