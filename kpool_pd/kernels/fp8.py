"""fp8 e4m3 helpers shared by the kpool ops (bit-exact, so every implementation agrees)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(x)) for positive normal fp32 x, computed on the bits (exact).

    # x: [...] fp32 > 0 -> [...] fp32
    """
    bits = x.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    exponent = exponent + has_mantissa.to(torch.int32)
    return (exponent << 23).view(torch.float32)


def quantize_fp8_rows(y: torch.Tensor, *, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation with one fp32 scale a row.

    # y: [P, D] fp32 (values already rounded to bf16) -> q: [P, D] float8_e4m3fn, scale: [P] fp32
    """
    amax = y.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    ratio = amax / FP8_MAX
    scale = pow2_ceil(ratio) if round_scale else ratio
    q = (y / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """# q: [..., D] float8_e4m3fn; scale: [...] fp32 -> [..., D] fp32"""
    return q.to(torch.float32) * scale[..., None]
