"""Compression of complete QSA groups into "normed, group-first-RoPE" rows (plain torch).

For one group of ``r`` raw keys ``k_0 .. k_{r-1}`` (per kv head, bf16[D]) the row is made in
three steps, each ending at a fixed rounding point:

1. ``pooled = (((k_0 + k_1) + k_2) + ... + k_{r-1}) / r``: the bf16 keys are widened to fp32
   and added one after another in slot order (a fixed order, so the result is deterministic
   and does not depend on how many groups are compressed together), then divided by ``r``
   in fp32; **rounded to bf16**.
2. Gemma-style RMSNorm of that bf16 value, in fp32:
   ``x * rsqrt(mean(x * x) + eps) * (1 + w)``, evaluated left to right (``(x * rsqrt(..)) *
   (1 + w)``). Every fp32 step has one defined result, so that a kernel can reproduce it bit
   for bit: the squares are summed by a pairwise tree (zero-padded to a power of two, then
   ``s[:n/2] + s[n/2:]`` until one value is left), divided by ``D`` (a true division), ``eps``
   is added, and ``rsqrt`` is ``1 / sqrt`` with both steps correctly rounded; **rounded to bf16**.
3. NeoX rotary in fp32 on the first ``rotary_dim`` dims of that bf16 value, at the MRoPE
   position of the group's **first** token (see ``kpool_pd.kernels.qsa_rope``); the other dims pass
   through; **cast to the cache dtype**: bf16 by round-to-nearest-even, or fp8 e4m3 with a
   static scale of 1.0: the fp32 value is clamped to [-448, 448] (so overflow saturates
   instead of becoming NaN) and cast with round-to-nearest-even. A reader dequantizes fp8
   rows by converting to fp32 (scale 1).

The rotary's cos/sin of a position that a given ``RopeCache`` holds are read from it (the same values,
computed once; see ``kpool_pd.kernels.qsa_rope.cache``).
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.fp8 import FP8_MAX
from kpool_pd.kernels.qsa_rope.cache import RopeCache
from kpool_pd.kernels.qsa_rope.ref import apply_neox_rotary, mrope_cos_sin

QSA_ROW_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def to_cache_dtype(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # x: [...] fp32 -> [...] out_dtype (bf16: RNE; fp8 e4m3: clamp to +-448, then RNE, scale 1.0)
    if out_dtype == torch.bfloat16:
        return x.to(torch.bfloat16)
    if out_dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {out_dtype}")


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    # x: [..., n] fp32 -> [...] fp32: zero-padded to a power of two, then halves added until one is left
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    if width != x.shape[-1]:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def rms_norm_gemma(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., D] fp32; weight: [D] fp32 -> [..., D] fp32: x * rsqrt(mean(x^2) + eps) * (1 + weight)
    dim = torch.tensor(float(x.shape[-1]), dtype=torch.float32, device=x.device)  # a true division on any device
    mean_square = pairwise_sum(x * x) / dim
    inv_rms = torch.reciprocal(torch.sqrt(mean_square + eps))[..., None]  # 1 / sqrt, each correctly rounded
    return x * inv_rms * (1.0 + weight)


def compress_group_keys(
    keys: torch.Tensor,
    first_positions: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    eps: float,
    rotary_dim: int,
    theta: float,
    section: tuple[int, int, int],
    out_dtype: torch.dtype,
    rope_cache: RopeCache | None = None,
) -> torch.Tensor:
    # keys: [G, r, H, D] bf16; first_positions: [G, 3] int64; norm_weight: [D] fp32 -> [G, H, D] out_dtype
    ratio = keys.shape[1]

    # 1. Mean of the group's keys: sequential fp32 sum over the slots, then / r; round to bf16.
    total = keys[:, 0].to(torch.float32)
    for i in range(1, ratio):
        total = total + keys[:, i].to(torch.float32)
    divisor = torch.tensor(float(ratio), dtype=torch.float32, device=keys.device)  # a true division on any device
    pooled = (total / divisor).to(torch.bfloat16)

    # 2. Gemma RMSNorm in fp32 on the bf16 value; round to bf16.
    normed = rms_norm_gemma(pooled.to(torch.float32), norm_weight, eps).to(torch.bfloat16)

    # 3. Rotary at the first token's MRoPE position in fp32; cast to the cache dtype.
    cos, sin = mrope_cos_sin(first_positions, rotary_dim=rotary_dim, theta=theta, section=section, cache=rope_cache)
    rotated = apply_neox_rotary(normed.to(torch.float32), cos, sin, rotary_dim)
    return to_cache_dtype(rotated, out_dtype)
