"""Triton kpool pool compression, and the per-tile compression that the prefill and decode kernels share.

The arithmetic follows ``ref.py`` operation for operation, so a compiled run gives the reference's
bytes: sequential max, exp, sequential sum, correctly rounded division (``div_rn``), separate
multiply and add (launched with ``enable_fp_fusion=False``), bf16 rounding to nearest even and the
e4m3 encoding done on the bits, and the Hadamard as the reference's butterflies, halves 64 to 1.
Each butterfly stage pairs the tile's top index bit and rotates it to the bottom, so after seven
stages the order is the original one.

Exp: compiled runs use libdevice's expf, the CUDA math library's accurate expf that torch's CUDA exp
calls too; the interpreter (CPU) uses numpy's exp, which differs from torch's CPU exp by an ulp on
some inputs, so softmax pools can differ from the reference there (the tests state the bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.dispatch import interpreting
from kernels.hadamard import INV_SQRT_DIM
from kvcache import PoolMode

DIM = 128
_INV_SQRT_DIM = tl.constexpr(INV_SQRT_DIM)


@triton.jit
def round_to_bf16(x):
    """fp32 -> fp32 holding the nearest-even bf16 value (finite x)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def encode_e4m3(v):
    """fp32 with |v| <= 448 -> float8_e4m3fn code as uint8, rounded to nearest even."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)  # 3 mantissa bits, exponent bias 7
    scaled = mag.to(tl.float32, bitcast=True) * 512.0  # subnormals: multiples of 2**-9
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.uint32)  # round to an integer, nearest even
    code = tl.where(mag >= 0x3C800000, normal, subnormal)  # 0x3C800000 = 2**-6, the least normal
    return (code | sign).to(tl.uint8)


@triton.jit
def decode_e4m3(code):
    """float8_e4m3fn code (uint8) -> its exact fp32 value (finite codes)."""
    bits = code.to(tl.uint32)
    sign = (bits & 0x80) << 24
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2**-9
    return tl.where(exponent == 0, tl.where(sign != 0, -subnormal, subnormal), normal)


@triton.jit
def fwht128(x, ROWS: tl.constexpr):
    """H_128 x per row by butterflies, halves 64, 32, ..., 1. # x: [ROWS, 128] fp32"""
    for _ in tl.static_range(7):
        a, b = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, 64)), (0, 2, 1)))
        x = tl.reshape(tl.join(a + b, a - b), (ROWS, 128))
    return x


@triton.jit
def _slot_offsets(i, row0, row_step, pos0, first_fresh, ring_row0, ring_size, ring_step, FROM_RING: tl.constexpr):
    """Element offsets of slot i of each pool, and whether it is read from the ring instead of the input.

    Input rows: row0 + i * row_step. With FROM_RING, positions below first_fresh live in the ring at
    ring_row0 + ((pos0 + i) % ring_size) * ring_step.
    """
    offset = row0 + i * row_step
    if FROM_RING:
        pos = pos0 + i
        old = pos < first_fresh
        return tl.where(old, 0, offset), tl.where(old, ring_row0 + (pos % ring_size) * ring_step, 0), old
    return offset, offset, offset < 0


@triton.jit
def _load_slot(i, k_ptr, g_ptr, ring_ptr, gate_half, row0, row_step, pos0, first_fresh, ring_row0, ring_size,
               ring_step, live, dims, FROM_RING: tl.constexpr):
    """k and gate of slot i as fp32. # -> [ROWS, 128] fp32 each"""
    offset, ring_offset, old = _slot_offsets(i, row0, row_step, pos0, first_fresh, ring_row0, ring_size, ring_step,
                                             FROM_RING)
    mask = live[:, None]
    if FROM_RING:
        fresh_mask = mask & ~old[:, None]
        ring_mask = mask & old[:, None]
        kv = tl.load(k_ptr + offset[:, None] + dims[None, :], mask=fresh_mask, other=0.0)
        gv = tl.load(g_ptr + offset[:, None] + dims[None, :], mask=fresh_mask, other=0.0)
        rk = tl.load(ring_ptr + ring_offset[:, None] + dims[None, :], mask=ring_mask, other=0.0)
        rg = tl.load(ring_ptr + gate_half + ring_offset[:, None] + dims[None, :], mask=ring_mask, other=0.0)
        return tl.where(old[:, None], rk, kv).to(tl.float32), tl.where(old[:, None], rg, gv).to(tl.float32)
    kv = tl.load(k_ptr + offset[:, None] + dims[None, :], mask=mask, other=0.0)
    gv = tl.load(g_ptr + offset[:, None] + dims[None, :], mask=mask, other=0.0)
    return kv.to(tl.float32), gv.to(tl.float32)


@triton.jit
def compress_tile(k_ptr, g_ptr, ape_ptr, ring_ptr, gate_half, row0, row_step, pos0, first_fresh, ring_row0,
                  ring_size, ring_step, live, ROWS: tl.constexpr, KPOOL: tl.constexpr, SOFTMAX: tl.constexpr,
                  ROUND_SCALE: tl.constexpr, PRECISE_EXP: tl.constexpr, FROM_RING: tl.constexpr):
    """Compress ROWS pools. # -> codes: [ROWS, 128] uint8 (e4m3 bits), scale: [ROWS] fp32"""
    dims = tl.arange(0, 128)
    if SOFTMAX:
        peak = tl.full((ROWS, 128), float("-inf"), tl.float32)
        for i in tl.static_range(KPOOL):
            _, g = _load_slot(i, k_ptr, g_ptr, ring_ptr, gate_half, row0, row_step, pos0, first_fresh, ring_row0,
                              ring_size, ring_step, live, dims, FROM_RING)
            logit = g + tl.load(ape_ptr + i * 128 + dims)[None, :]
            if i == 0:
                peak = logit
            else:
                peak = tl.maximum(peak, logit)
        total = tl.zeros((ROWS, 128), tl.float32)
        for i in tl.static_range(KPOOL):
            _, g = _load_slot(i, k_ptr, g_ptr, ring_ptr, gate_half, row0, row_step, pos0, first_fresh, ring_row0,
                              ring_size, ring_step, live, dims, FROM_RING)
            shifted = (g + tl.load(ape_ptr + i * 128 + dims)[None, :]) - peak
            if PRECISE_EXP:
                e = libdevice.exp(shifted)
            else:
                e = tl.exp(shifted)
            if i == 0:
                total = e
            else:
                total = total + e
        x = tl.zeros((ROWS, 128), tl.float32)
        for i in tl.static_range(KPOOL):
            kv, g = _load_slot(i, k_ptr, g_ptr, ring_ptr, gate_half, row0, row_step, pos0, first_fresh, ring_row0,
                               ring_size, ring_step, live, dims, FROM_RING)
            shifted = (g + tl.load(ape_ptr + i * 128 + dims)[None, :]) - peak
            if PRECISE_EXP:
                e = libdevice.exp(shifted)
            else:
                e = tl.exp(shifted)
            term = tl.math.div_rn(e, total) * kv
            if i == 0:
                x = term
            else:
                x = x + term
    else:
        x, _ = _load_slot(KPOOL - 1, k_ptr, g_ptr, ring_ptr, gate_half, row0, row_step, pos0, first_fresh,
                          ring_row0, ring_size, ring_step, live, dims, FROM_RING)
    x = round_to_bf16(x)
    y = round_to_bf16(fwht128(x, ROWS) * _INV_SQRT_DIM)
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-4)
    ratio = tl.math.div_rn(amax, 448.0)
    if ROUND_SCALE:
        bits = ratio.to(tl.uint32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.uint32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
    else:
        scale = ratio
    q = tl.math.div_rn(y, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return encode_e4m3(q), scale


@triton.jit
def _compress_kernel(k_ptr, g_ptr, ape_ptr, q_ptr, scale_ptr, pools, pool_stride, slot_stride,
                     BLOCK_P: tl.constexpr, KPOOL: tl.constexpr, SOFTMAX: tl.constexpr, ROUND_SCALE: tl.constexpr,
                     PRECISE_EXP: tl.constexpr):
    # k, gate: [P, KPOOL, 128] bf16 (row stride 1 inside a slot); q: [P, 128] uint8; scale: [P] fp32
    rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = rows < pools
    row0 = rows * pool_stride
    codes, scale = compress_tile(k_ptr, g_ptr, ape_ptr, k_ptr, 0, row0, slot_stride, row0, 0, row0, 1, 0, live,
                                 BLOCK_P, KPOOL, SOFTMAX, ROUND_SCALE, PRECISE_EXP, False)
    dims = tl.arange(0, 128)
    tl.store(q_ptr + rows[:, None] * 128 + dims[None, :], codes, mask=live[:, None])
    tl.store(scale_ptr + rows, scale, mask=live)


def launch_options() -> dict:
    """Compile options every kpool kernel launches with: no fused multiply-add (the reference rounds
    each product and each sum)."""
    return {"enable_fp_fusion": False}


def compress_pools_triton(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, *, mode: PoolMode,
                          round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """# k, gate: [P, kpool, 128] bf16; ape: [kpool, 128] fp32 -> q: [P, 128] float8_e4m3fn, scale: [P] fp32"""
    pools, kpool, _ = k.shape
    k, gate, ape = k.contiguous(), gate.contiguous(), ape.contiguous()
    q = torch.empty(pools, DIM, dtype=torch.float8_e4m3fn, device=k.device)
    scale = torch.empty(pools, dtype=torch.float32, device=k.device)
    if pools == 0:
        return q, scale
    block_p = 16 if k.is_cuda else 4
    _compress_kernel[(triton.cdiv(pools, block_p),)](
        k, gate, ape, q.view(torch.uint8), scale, pools, kpool * DIM, DIM,
        BLOCK_P=block_p, KPOOL=kpool, SOFTMAX=mode is PoolMode.SOFTMAX, ROUND_SCALE=round_scale,
        PRECISE_EXP=not interpreting(), num_warps=4, **launch_options(),
    )
    return q, scale
