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

from kpool_pd.kernels.dispatch import interpreting
from kpool_pd.kernels.hadamard import INV_SQRT_DIM
from kpool_pd.kernels.triton_helpers import FP8_LIMIT, encode_e4m3, launch_options, round_to_bf16
from kpool_pd.kvcache import PoolMode

DIM = 128
_INV_SQRT_DIM = tl.constexpr(INV_SQRT_DIM)


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, HALF: tl.constexpr):
    """One butterfly stage in place: x[i] + x[i + HALF] at i, x[i] - x[i + HALF] at i + HALF, for i with
    bit HALF clear. # x: [ROWS, 128] fp32"""
    a, b = tl.split(tl.permute(tl.reshape(x, (ROWS, 64 // HALF, 2, HALF)), (0, 1, 3, 2)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, 128))


@triton.jit
def fwht128(x, ROWS: tl.constexpr):
    """H_128 x per row by butterflies, halves 64, 32, ..., 1. # x: [ROWS, 128] fp32"""
    x = _butterfly(x, ROWS, 64)
    x = _butterfly(x, ROWS, 32)
    x = _butterfly(x, ROWS, 16)
    x = _butterfly(x, ROWS, 8)
    x = _butterfly(x, ROWS, 4)
    x = _butterfly(x, ROWS, 2)
    x = _butterfly(x, ROWS, 1)
    return x


@triton.jit
def _load_slot(i, k_ptr, g_ptr, ring_ptr, gate_half, fresh_offset, row_step, pos0, first_fresh, ring_row0,
               ring_size: tl.constexpr, ring_step, mask, dims, FROM_RING: tl.constexpr):
    """k and gate of slot i of each pool as fp32. # -> [ROWS, 128] fp32 each

    Input rows: ``fresh_offset`` ([ROWS, 128] element offsets of slot 0) + i * row_step. With FROM_RING, positions
    below first_fresh are read from the ring at ring_row0 + ((pos0 + i) % ring_size) * ring_step instead.
    """
    offset = fresh_offset + i * row_step
    if FROM_RING:
        pos = pos0 + i
        old = (pos < first_fresh)[:, None]
        ring_offset = (ring_row0 + (pos % ring_size) * ring_step)[:, None] + dims[None, :]
        kv = tl.load(k_ptr + offset, mask=mask & ~old, other=0.0)
        gv = tl.load(g_ptr + offset, mask=mask & ~old, other=0.0)
        rk = tl.load(ring_ptr + ring_offset, mask=mask & old, other=0.0)
        rg = tl.load(ring_ptr + gate_half + ring_offset, mask=mask & old, other=0.0)
        return tl.where(old, rk, kv).to(tl.float32), tl.where(old, rg, gv).to(tl.float32)
    kv = tl.load(k_ptr + offset, mask=mask, other=0.0)
    gv = tl.load(g_ptr + offset, mask=mask, other=0.0)
    return kv.to(tl.float32), gv.to(tl.float32)


@triton.jit
def compress_tile(k_ptr, g_ptr, ape_ptr, ring_ptr, gate_half, row0, row_step, pos0, first_fresh, ring_row0,
                  ring_size: tl.constexpr, ring_step, live, ROWS: tl.constexpr, KPOOL: tl.constexpr,
                  SOFTMAX: tl.constexpr,
                  ROUND_SCALE: tl.constexpr, PRECISE_EXP: tl.constexpr, FROM_RING: tl.constexpr):
    """Compress ROWS pools. # -> codes: [ROWS, 128] uint8 (e4m3 bits), scale: [ROWS] fp32

    Slot i of pool r is input row row0[r] + i * row_step (element offsets), or with FROM_RING and a position
    pos0[r] + i below first_fresh, ring row ring_row0[r] + ((pos0[r] + i) % ring_size) * ring_step. Each slot is
    loaded once and its logit and exp kept in registers (KPOOL is a compile-time constant): one pass over the
    slots for the max, then the exps and their sequential sum, then the weighted sum, in the reference's order.
    """
    dims = tl.arange(0, 128)
    mask = live[:, None]
    fresh_offset = row0[:, None] + dims[None, :]
    if SOFTMAX:
        keys = ()
        logits = ()
        for i in tl.static_range(KPOOL):
            kv, g = _load_slot(i, k_ptr, g_ptr, ring_ptr, gate_half, fresh_offset, row_step, pos0, first_fresh,
                               ring_row0, ring_size, ring_step, mask, dims, FROM_RING)
            keys = keys + (kv,)
            logits = logits + (g + tl.load(ape_ptr + i * 128 + dims)[None, :],)
        peak = logits[0]
        for i in tl.static_range(1, KPOOL):
            peak = tl.maximum(peak, logits[i])
        exps = ()
        for i in tl.static_range(KPOOL):
            if PRECISE_EXP:
                exps = exps + (libdevice.exp(logits[i] - peak),)
            else:
                exps = exps + (tl.exp(logits[i] - peak),)
        total = exps[0]
        for i in tl.static_range(1, KPOOL):
            total = total + exps[i]
        x = tl.math.div_rn(exps[0], total) * keys[0]
        for i in tl.static_range(1, KPOOL):
            x = x + tl.math.div_rn(exps[i], total) * keys[i]
    else:
        x, _ = _load_slot(KPOOL - 1, k_ptr, g_ptr, ring_ptr, gate_half, fresh_offset, row_step, pos0, first_fresh,
                          ring_row0, ring_size, ring_step, mask, dims, FROM_RING)
    x = round_to_bf16(x)
    y = round_to_bf16(fwht128(x, ROWS) * _INV_SQRT_DIM)
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-4)
    ratio = tl.math.div_rn(amax, FP8_LIMIT)
    if ROUND_SCALE:
        bits = ratio.to(tl.uint32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.uint32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
        # 1 / scale is a power of two too (exponent lies in [105, 248]), so y * (1 / scale) is y / scale
        # correctly rounded: the same bits as the division, for one multiply
        inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
        q = y * inverse[:, None]
    else:
        scale = ratio
        q = tl.math.div_rn(y, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_LIMIT), FP8_LIMIT)
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
