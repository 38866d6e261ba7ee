"""Triton QSA group compression, and the per-tile compression that the forward update shares.

The arithmetic follows ``ref.py`` step for step: the slots are widened and added in slot order,
divided by ``r`` (``div_rn``); the squares are summed by the reference's pairwise tree (halves
added, zero padding to a power of two), divided by ``D``, ``eps`` added, then ``1 / sqrt`` with a
correctly rounded square root and division; products and sums are separate (launched with
``enable_fp_fusion=False``); bf16 rounding to nearest even and the e4m3 encoding are done on the
bits (the interpreter's own bf16 and fp8 casts are not to be trusted, see the tests). Keys and
outputs move as integer bit patterns. NaN bits are not specified (torch's own casts differ by path).

cos/sin: compiled runs use libdevice's cosf/sinf, the CUDA math library that torch's CUDA cos/sin
call, so a GPU run matches the reference run on the GPU; the interpreter uses numpy's float32
cos/sin, which can differ from torch's CPU ones by an ulp (the tests state the bound).

The rotary pairs dim ``d`` with ``d +- rotary_dim / 2``; rather than moving values between lanes,
each tile is also computed at the partner columns (the same loads, cached), which keeps every
element's arithmetic the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.dispatch import interpreting
from kernels.kpool_compress.triton import encode_e4m3, round_to_bf16
from kernels.qsa_rope.ref import rope_inv_freq

FP8_MAX = 448.0


def launch_options() -> dict:
    """No fused multiply-add: the reference rounds each product and each sum."""
    return {"enable_fp_fusion": False}


@triton.jit
def bf16_bits_to_f32(bits):
    """int16 bit patterns of bf16 -> their exact fp32 values."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 -> int16 bit pattern of the nearest-even bf16; NaN -> 0x7FFF (torch's own casts write other NaN
    bits on other paths: 0xFFFF vectorised on CPU, 0x7FC0 scalar; a NaN is compared as a NaN)."""
    rounded = round_to_bf16(x).to(tl.uint32, bitcast=True) >> 16
    rounded = tl.where(x != x, 0x7FFF, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def f32_to_e4m3_bits(x):
    """fp32 -> uint8 e4m3 code: clamp to [-448, 448], nearest even (NaN -> 0x7F with its sign, as torch)."""
    clamped = tl.minimum(tl.maximum(x, -448.0), 448.0)
    nan_code = 0x7F | ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    return tl.where(x != x, nan_code, encode_e4m3(clamped).to(tl.int32)).to(tl.uint8)


@triton.jit
def pairwise_total(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """Per row, the reference's pairwise tree sum of N (a power of two) values. # x: [ROWS, N] -> [ROWS]

    Each stage adds the first half to the second and writes the sums back twice, so the tile keeps
    its shape; the next stage then pairs sum k with sum k + n/4, the tree's next level."""
    for _ in tl.static_range(LOG_N):
        a, b = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, N // 2)), (0, 2, 1)))
        s = a + b
        x = tl.reshape(tl.join(s, s), (ROWS, N))
    first = tl.arange(0, N) == 0
    return tl.sum(tl.where(first[None, :], x, 0.0), axis=1)  # column 0 (every column holds the total; NaN kept)


@triton.jit
def _pooled(k_ptr, ring_ptr, cols, key_row0, key_step, ring_row0, ring_step, pos0, first_fresh, cap, live,
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
def compress_tile(k_ptr, ring_ptr, w_ptr, inv_freq_ptr, key_row0, key_step, ring_row0, ring_step, pos0,
                  first_fresh, cap, first_t, first_h, first_w, live, eps, ROWS: tl.constexpr,
                  R: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, LOG_D: tl.constexpr, ROT: tl.constexpr,
                  S1: tl.constexpr, S2: tl.constexpr, FROM_RING: tl.constexpr, PRECISE: tl.constexpr):
    """One head of ROWS groups: pooled -> RMSNorm -> MRoPE rotary, fp32 before the cache cast.

    # first_t, first_h, first_w: [ROWS] int64 (the group's first MRoPE position) -> [ROWS, D_P2] fp32"""
    HALF: tl.constexpr = ROT // 2
    cols = tl.arange(0, D_P2)
    partner = tl.where(cols < HALF, cols + HALF, tl.where(cols < ROT, cols - HALF, cols))
    x = _pooled(k_ptr, ring_ptr, cols, key_row0, key_step, ring_row0, ring_step, pos0, first_fresh, cap, live,
                ROWS, R, D, D_P2, FROM_RING)
    xp = _pooled(k_ptr, ring_ptr, partner, key_row0, key_step, ring_row0, ring_step, pos0, first_fresh, cap,
                 live, ROWS, R, D, D_P2, FROM_RING)

    mean_square = tl.math.div_rn(pairwise_total(x * x, ROWS, D_P2, LOG_D), tl.full((ROWS,), D, tl.float32))
    inv_rms = tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32), tl.math.sqrt_rn(mean_square + eps))
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    wp = tl.load(w_ptr + partner, mask=partner < D, other=0.0)
    x = round_to_bf16((x * inv_rms[:, None]) * (1.0 + w)[None, :])
    xp = round_to_bf16((xp * inv_rms[:, None]) * (1.0 + wp)[None, :])

    # Pair j of column d: d or d - HALF; its axis: height where j % 3 == 1 and j < 3 * S1, width where
    # j % 3 == 2 and j < 3 * S2, time otherwise.
    pair = tl.where(cols < HALF, cols, cols - HALF)
    is_h = ((pair % 3) == 1) & (pair < 3 * S1)
    is_w = ((pair % 3) == 2) & (pair < 3 * S2)
    position = tl.where(is_h[None, :], first_h[:, None], tl.where(is_w[None, :], first_w[:, None], first_t[:, None]))
    inv_freq = tl.load(inv_freq_ptr + pair, mask=cols < ROT, other=0.0)
    angle = position.to(tl.float32) * inv_freq[None, :]
    if PRECISE:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    first_half = (x * cos) - (xp * sin)
    second_half = (x * cos) + (xp * sin)
    return tl.where((cols < HALF)[None, :], first_half, tl.where((cols < ROT)[None, :], second_half, x))


@triton.jit
def _compress_kernel(k_ptr, pos_ptr, w_ptr, inv_freq_ptr, out_ptr, groups, heads, eps,
                     R: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, LOG_D: tl.constexpr, ROT: tl.constexpr,
                     S1: tl.constexpr, S2: tl.constexpr, BLOCK_G: tl.constexpr, FP8: tl.constexpr, PRECISE: tl.constexpr):
    # keys: [G, R, H, D] int16 (bf16 bits); positions: [G, 3] int64; out: [G, H, D] int16 | uint8
    rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    live = rows < groups
    first_t = tl.load(pos_ptr + rows * 3, mask=live, other=0)
    first_h = tl.load(pos_ptr + rows * 3 + 1, mask=live, other=0)
    first_w = tl.load(pos_ptr + rows * 3 + 2, mask=live, other=0)
    cols = tl.arange(0, D_P2)
    for h in range(heads):
        key_row0 = (rows * R * heads + h) * D
        y = compress_tile(k_ptr, k_ptr, w_ptr, inv_freq_ptr, key_row0, heads * D, key_row0, 0, rows, rows, 1,
                          first_t, first_h, first_w, live, eps, BLOCK_G, R, D, D_P2, LOG_D, ROT, S1, S2, False,
                          PRECISE)
        out = out_ptr + ((rows * heads + h) * D)[:, None] + cols[None, :]
        mask = live[:, None] & (cols < D)[None, :]
        if FP8:
            tl.store(out, f32_to_e4m3_bits(y), mask=mask)
        else:
            tl.store(out, f32_to_bf16_bits(y), mask=mask)


def rope_table(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """inv_freq: [rotary_dim // 2] fp32, made on the device (capturable; no host copy)."""
    return rope_inv_freq(rotary_dim, theta, device)


def compress_group_keys_triton(
    keys: torch.Tensor, first_positions: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, rotary_dim: int,
    theta: float, section: tuple[int, int, int], out_dtype: torch.dtype,
) -> torch.Tensor:
    # keys: [G, r, H, D] bf16; first_positions: [G, 3] int64; norm_weight: [D] fp32 -> [G, H, D] out_dtype
    groups, ratio, heads, head_size = keys.shape
    out = torch.empty(groups, heads, head_size, dtype=out_dtype, device=keys.device)
    if groups == 0 or heads == 0:
        return out
    bits = torch.uint8 if out_dtype == torch.float8_e4m3fn else torch.int16
    block_g = 16 if keys.is_cuda else 4
    _compress_kernel[(triton.cdiv(groups, block_g),)](
        keys.contiguous().view(torch.int16), first_positions.contiguous(), norm_weight.contiguous(),
        rope_table(rotary_dim, theta, keys.device), out.view(bits), groups, heads, float(eps),
        R=ratio, D=head_size, D_P2=triton.next_power_of_2(head_size),
        LOG_D=triton.next_power_of_2(head_size).bit_length() - 1, ROT=rotary_dim, S1=section[1], S2=section[2],
        BLOCK_G=block_g, FP8=out_dtype == torch.float8_e4m3fn, PRECISE=not interpreting(), num_warps=4,
        **launch_options(),
    )
    return out
