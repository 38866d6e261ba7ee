"""Triton QSA group compression, and the per-tile compression that the forward update shares.

The arithmetic follows ``ref.py`` step for step: the slots are widened and added in slot order,
divided by ``r`` (``div_rn``); the squares are summed by the reference's pairwise tree (halves
added, zero padding to a power of two), divided by ``D``, ``eps`` added, then ``1 / sqrt`` with a
correctly rounded square root and division; products and sums are separate (launched with
``enable_fp_fusion=False``); bf16 rounding to nearest even and the e4m3 encoding are done on the
bits (the interpreter's own bf16 and fp8 casts are not to be trusted, see the tests). Keys and
outputs move as integer bit patterns. NaN bits are not specified (torch's own casts differ by path).

cos/sin: given a ``RopeCache`` (``kpool_pd.kernels.qsa_rope.cache``), a position it holds reads its row, which
torch computed with the reference's own ops; the others are computed: compiled runs use libdevice's
cosf/sinf, the CUDA math library that torch's CUDA cos/sin call, so a GPU run matches the reference
run on the GPU; the interpreter uses numpy's float32 cos/sin, which can differ from torch's CPU ones
by an ulp (the tests state the bound). (Measured on the H200 with positions up to 2**20: the table
saves about 4% of a prefill update and nothing measurable of a decode step; the cos/sin are not
where a group's time goes.)

The rotary pairs dim ``d`` with ``d +- rotary_dim / 2``. When rotary_dim is a power of two dividing
the padded head size (the model's 64 of 128), the partner's normed value is the tile with its two
rotary halves swapped (split / join, no reload), and computed cos/sin are computed once per rotary
pair and spread to both of its columns: each element's arithmetic is the reference's and is done once.
Otherwise the tile is also computed at the partner columns (the same loads, cached) and cos/sin once
per column (measured slower on the H200 even for the model's sizes, where both apply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kpool_pd.kernels.dispatch import interpreting
from kpool_pd.kernels.qsa_rope.cache import RopeCache
from kpool_pd.kernels.qsa_rope.cache import rope_inv_freq
from kpool_pd.kernels.triton_helpers import (bf16_bits_to_f32, f32_to_bf16_bits, f32_to_e4m3_bits, launch_options,
                                    round_to_bf16)


@triton.jit
def pairwise_total(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """Per row, the reference's pairwise tree sum of N (a power of two) values. # x: [ROWS, N] -> [ROWS]

    Each stage views the row as its two halves and adds them (a sum over an axis of two: one exact,
    commutative addition, whichever thread holds which half), so the next stage pairs sum k with sum
    k + n/4, the tree's next level; a NaN anywhere stays NaN."""
    for k in tl.static_range(LOG_N):
        x = tl.sum(tl.reshape(x, (ROWS, 2, N >> (k + 1))), axis=1)
    return tl.reshape(x, (ROWS,))


@triton.jit
def _pooled(k_ptr, ring_ptr, cols, key_row0, key_step, ring_row0, ring_step, pos0, first_fresh, cap: tl.constexpr, live,
            ROWS: tl.constexpr, R: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, FROM_RING: tl.constexpr):
    """bf16-rounded mean of the group's R keys at columns ``cols``, as fp32. # -> [ROWS, len(cols)]

    Slot i of row w: input row key_row0[w] + i * key_step (elements, int16 view); with FROM_RING,
    positions pos0[w] + i below first_fresh[w] come from ring_row0[w] + ((pos0[w] + i) % cap) * ring_step."""
    col_ok = cols < D
    total = tl.zeros((ROWS, D_P2), tl.float32)
    for i in tl.static_range(R):
        in_chunk = live
        if FROM_RING:
            pos = pos0 + i
            old = pos < first_fresh
            in_chunk = live & ~old
            ring_at = ring_row0 + (pos % cap) * ring_step
            from_ring = tl.load(ring_ptr + ring_at[:, None] + cols[None, :],
                                mask=(live & old)[:, None] & col_ok[None, :], other=0)
        bits = tl.load(k_ptr + (key_row0 + i * key_step)[:, None] + cols[None, :],
                       mask=in_chunk[:, None] & col_ok[None, :], other=0)
        if FROM_RING:
            bits = tl.where(old[:, None], from_ring, bits)
        value = bf16_bits_to_f32(bits)
        if i == 0:
            total = value
        else:
            total = total + value
    return round_to_bf16(tl.math.div_rn(total, tl.full((ROWS, D_P2), R, tl.float32)))


@triton.jit
def _halves_swapped(x, ROWS: tl.constexpr, N: tl.constexpr, ROT: tl.constexpr):
    """x with columns [0, ROT/2) and [ROT/2, ROT) swapped, the rest unchanged (ROT a power of two dividing N).
    # x: [ROWS, N] -> [ROWS, N]"""
    parts = tl.permute(tl.reshape(x, (ROWS, N // ROT, 2, ROT // 2)), (0, 1, 3, 2))
    low, high = tl.split(parts)
    swapped = tl.reshape(tl.permute(tl.join(high, low), (0, 1, 3, 2)), (ROWS, N))
    cols = tl.arange(0, N)
    return tl.where((cols < ROT)[None, :], swapped, x)


@triton.jit
def _spread_pairs(pair_values, fill, ROWS: tl.constexpr, N: tl.constexpr, ROT: tl.constexpr):
    """Per-pair values -> per-column ones: column d < ROT takes pair d % (ROT/2), the columns past ROT ``fill``.
    # pair_values: [ROWS, ROT/2] -> [ROWS, N] (ROT a power of two dividing N)"""
    both = tl.reshape(tl.permute(tl.join(pair_values, pair_values), (0, 2, 1)), (ROWS, ROT))
    for _ in tl.static_range(8):  # doublings up to N (N / ROT <= 256): [values, fill, fill, ...]
        if both.shape[1] < N:
            both = tl.reshape(tl.permute(tl.join(both, tl.full(both.shape, fill, both.dtype)), (0, 2, 1)),
                              (ROWS, 2 * both.shape[1]))
    return both


@triton.jit
def _pair_positions(pair, first_t, first_h, first_w, S1: tl.constexpr, S2: tl.constexpr):
    """Each rotary pair's MRoPE position: height where j % 3 == 1 and j < 3 * S1, width where j % 3 == 2 and
    j < 3 * S2, time otherwise. # pair: [N] int; first_*: [ROWS] int64 -> [ROWS, N] int64"""
    is_h = ((pair % 3) == 1) & (pair < 3 * S1)
    is_w = ((pair % 3) == 2) & (pair < 3 * S2)
    return tl.where(is_h[None, :], first_h[:, None], tl.where(is_w[None, :], first_w[:, None], first_t[:, None]))


@triton.jit
def _computed_cos_sin(inv_freq_ptr, first_t, first_h, first_w, ROWS: tl.constexpr, D_P2: tl.constexpr,
                      ROT: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, PAIRED: tl.constexpr,
                      PRECISE: tl.constexpr):
    """cos/sin computed in the kernel (``rope_cos_sin`` without a table). # -> 2 x [ROWS, D_P2] fp32"""
    HALF: tl.constexpr = ROT // 2
    if PAIRED:
        pair = tl.arange(0, HALF)
        live = pair < HALF
    else:
        cols = tl.arange(0, D_P2)
        pair = tl.where(cols < HALF, cols, cols - HALF)
        live = cols < ROT
    position = _pair_positions(pair, first_t, first_h, first_w, S1, S2)
    inv_freq = tl.load(inv_freq_ptr + pair, mask=live, other=0.0)
    angle = position.to(tl.float32) * inv_freq[None, :]
    if PRECISE:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    if PAIRED:
        cos = _spread_pairs(cos, 1.0, ROWS, D_P2, ROT)
        sin = _spread_pairs(sin, 0.0, ROWS, D_P2, ROT)
    return cos, sin


@triton.jit
def rope_cos_sin(inv_freq_ptr, table_ptr, table_rows, first_t, first_h, first_w, ROWS: tl.constexpr,
                 D_P2: tl.constexpr, ROT: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, PAIRED: tl.constexpr,
                 PRECISE: tl.constexpr, TABLE: tl.constexpr):
    """cos and sin of each column's rotary angle at the group's first MRoPE position; columns past the rotary
    get cos 1, sin 0. One tile serves every head. # first_*: [ROWS] int64 -> 2 x [ROWS, D_P2] fp32

    With TABLE (a ``RopeCache``: [table_rows, ROT] fp32, row p = cos of the pairs at p, then their sin), a
    column whose pair position lies in [0, table_rows) loads its values; any other is computed, and only
    when the tile holds one (a branch on the whole tile). Computed: the angle is fp32(position) * inv_freq[j],
    one product, as the reference's; with PAIRED (ROT a power of two dividing D_P2) cos/sin are computed once
    per rotary pair and spread to the pair's two columns, else once per column (the same values)."""
    if TABLE:
        HALF: tl.constexpr = ROT // 2
        cols = tl.arange(0, D_P2)
        pair = tl.where(cols < HALF, cols, cols - HALF)
        rotary = (cols < ROT)[None, :]
        position = _pair_positions(pair, first_t, first_h, first_w, S1, S2)
        held = (position >= 0) & (position < table_rows)
        at = table_ptr + position * ROT + pair[None, :]
        cos = tl.load(at, mask=rotary & held, other=1.0)
        sin = tl.load(at + HALF, mask=rotary & held, other=0.0)
        outside = rotary & ~held
        if tl.max(outside.to(tl.int32)) > 0:
            computed_cos, computed_sin = _computed_cos_sin(inv_freq_ptr, first_t, first_h, first_w, ROWS, D_P2, ROT,
                                                           S1, S2, PAIRED, PRECISE)
            cos = tl.where(outside, computed_cos, cos)
            sin = tl.where(outside, computed_sin, sin)
    else:
        cos, sin = _computed_cos_sin(inv_freq_ptr, first_t, first_h, first_w, ROWS, D_P2, ROT, S1, S2, PAIRED,
                                     PRECISE)
    return cos, sin


@triton.jit
def compress_tile(k_ptr, ring_ptr, w_ptr, key_row0, key_step, ring_row0, ring_step, pos0, first_fresh,
                  cap: tl.constexpr, cos, sin, live, eps, ROWS: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                  D_P2: tl.constexpr, LOG_D: tl.constexpr, ROT: tl.constexpr, PAIRED: tl.constexpr,
                  FROM_RING: tl.constexpr):
    """One head of ROWS groups: pooled -> RMSNorm -> MRoPE rotary, fp32 before the cache cast.

    The rotary partner of column d (d + ROT/2 or d - ROT/2): with PAIRED, the normed tile with its halves
    swapped; else the same steps done at the partner columns. Either way every element's arithmetic is the
    reference's. # cos, sin: [ROWS, D_P2] fp32 (``rope_cos_sin``) -> [ROWS, D_P2] fp32"""
    HALF: tl.constexpr = ROT // 2
    cols = tl.arange(0, D_P2)
    x = _pooled(k_ptr, ring_ptr, cols, key_row0, key_step, ring_row0, ring_step, pos0, first_fresh, cap, live,
                ROWS, R, D, D_P2, FROM_RING)
    mean_square = tl.math.div_rn(pairwise_total(x * x, ROWS, D_P2, LOG_D), tl.full((ROWS,), D, tl.float32))
    inv_rms = tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), tl.math.sqrt_rn(mean_square + eps))
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    if PAIRED:
        x = round_to_bf16((x * inv_rms[:, None]) * (1.0 + w)[None, :])
        xp = _halves_swapped(x, ROWS, D_P2, ROT)
    else:
        partner = tl.where(cols < HALF, cols + HALF, tl.where(cols < ROT, cols - HALF, cols))
        xp = _pooled(k_ptr, ring_ptr, partner, key_row0, key_step, ring_row0, ring_step, pos0, first_fresh, cap,
                     live, ROWS, R, D, D_P2, FROM_RING)
        wp = tl.load(w_ptr + partner, mask=partner < D, other=0.0)
        x = round_to_bf16((x * inv_rms[:, None]) * (1.0 + w)[None, :])
        xp = round_to_bf16((xp * inv_rms[:, None]) * (1.0 + wp)[None, :])
    first_half = (x * cos) - (xp * sin)
    second_half = (x * cos) + (xp * sin)
    return tl.where((cols < HALF)[None, :], first_half, tl.where((cols < ROT)[None, :], second_half, x))


def rope_pairs_fit(rotary_dim: int, head_size: int) -> bool:
    """The rotary pairs can be computed once and spread (PAIRED): rotary_dim a power of two (>= 2) dividing the
    head size padded to a power of two."""
    padded = triton.next_power_of_2(head_size)
    return rotary_dim >= 2 and rotary_dim & (rotary_dim - 1) == 0 and padded % rotary_dim == 0


@triton.jit
def _compress_kernel(k_ptr, pos_ptr, w_ptr, inv_freq_ptr, table_ptr, table_rows, out_ptr, groups, heads, eps,
                     R: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, LOG_D: tl.constexpr, ROT: tl.constexpr,
                     S1: tl.constexpr, S2: tl.constexpr, PAIRED: tl.constexpr, BLOCK_G: tl.constexpr,
                     FP8: tl.constexpr, PRECISE: tl.constexpr, TABLE: tl.constexpr):
    # keys: [G, R, H, D] int16 (bf16 bits); positions: [G, 3] int64; out: [G, H, D] int16 | uint8
    # table: [table_rows, ROT] fp32 (with TABLE)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    live = rows < groups
    first_t = tl.load(pos_ptr + rows * 3, mask=live, other=0)
    first_h = tl.load(pos_ptr + rows * 3 + 1, mask=live, other=0)
    first_w = tl.load(pos_ptr + rows * 3 + 2, mask=live, other=0)
    cols = tl.arange(0, D_P2)
    cos, sin = rope_cos_sin(inv_freq_ptr, table_ptr, table_rows, first_t, first_h, first_w, BLOCK_G, D_P2, ROT, S1, S2,
                            PAIRED, PRECISE, TABLE)
    for h in range(heads):
        key_row0 = (rows * R * heads + h) * D
        y = compress_tile(k_ptr, k_ptr, w_ptr, key_row0, heads * D, key_row0, 0, rows, rows, 1, cos, sin, live, eps,
                          BLOCK_G, R, D, D_P2, LOG_D, ROT, PAIRED, False)
        out = out_ptr + ((rows * heads + h) * D)[:, None] + cols[None, :]
        mask = live[:, None] & (cols < D)[None, :]
        if FP8:
            tl.store(out, f32_to_e4m3_bits(y), mask=mask)
        else:
            tl.store(out, f32_to_bf16_bits(y), mask=mask)


def inv_freq_table(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """inv_freq: [rotary_dim // 2] fp32 on the device, read-only for the kernels. Made once per (rotary_dim,
    theta, device) and kept (a constant table: a call, and a CUDA graph that captures one, then spends no launches
    rebuilding it). While a CUDA graph is being captured a kept table is read as it is; one not made yet is made
    inside the graph (on the device, no host copy) and not kept (its memory belongs to the graph)."""
    key = (rotary_dim, float(theta), device)
    table = _KEPT_ROPE_TABLES.get(key)
    if table is not None:
        return table
    table = rope_inv_freq(rotary_dim, theta, device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _KEPT_ROPE_TABLES[key] = table
    return table


_KEPT_ROPE_TABLES: dict[tuple[int, float, torch.device], torch.Tensor] = {}


def rope_cache_args(rope_cache: RopeCache | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The kernels' (table pointer, table rows) of a ``RopeCache``; without one, a placeholder pointer and 0 rows
    (the kernel is then compiled with TABLE off and reads neither)."""
    if rope_cache is None:
        return placeholder, 0
    return rope_cache.table, rope_cache.num_positions


def compress_group_keys_triton(
    keys: torch.Tensor, first_positions: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, rotary_dim: int,
    theta: float, section: tuple[int, int, int], out_dtype: torch.dtype, rope_cache: RopeCache | None = None,
) -> torch.Tensor:
    # keys: [G, r, H, D] bf16; first_positions: [G, 3] int64; norm_weight: [D] fp32 -> [G, H, D] out_dtype
    groups, ratio, heads, head_size = keys.shape
    out = torch.empty(groups, heads, head_size, dtype=out_dtype, device=keys.device)
    if groups == 0 or heads == 0:
        return out
    bits = torch.uint8 if out_dtype == torch.float8_e4m3fn else torch.int16
    block_g = 16 if keys.is_cuda else 4
    inv_freq = inv_freq_table(rotary_dim, theta, keys.device)
    _compress_kernel[(triton.cdiv(groups, block_g),)](
        keys.contiguous().view(torch.int16), first_positions.contiguous(), norm_weight.contiguous(), inv_freq,
        *rope_cache_args(rope_cache, inv_freq), out.view(bits), groups, heads, float(eps),
        R=ratio, D=head_size, D_P2=triton.next_power_of_2(head_size),
        LOG_D=triton.next_power_of_2(head_size).bit_length() - 1, ROT=rotary_dim, S1=section[1], S2=section[2],
        PAIRED=rope_pairs_fit(rotary_dim, head_size),
        BLOCK_G=block_g, FP8=out_dtype == torch.float8_e4m3fn, PRECISE=not interpreting(),
        TABLE=rope_cache is not None, num_warps=4,
        **launch_options(),
    )
    return out
