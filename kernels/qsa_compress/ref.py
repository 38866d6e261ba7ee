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
   position of the group's **first** token (see ``kernels.qsa_rope``); the other dims pass
   through; **cast to the cache dtype**: bf16 by round-to-nearest-even, or fp8 e4m3 with a
   static scale of 1.0: the fp32 value is clamped to [-448, 448] (so overflow saturates
   instead of becoming NaN) and cast with round-to-nearest-even. A reader dequantizes fp8
   rows by converting to fp32 (scale 1).
"""

from __future__ import annotations

import torch

from kernels.qsa_rope.ref import apply_neox_rotary, mrope_cos_sin

FP8_E4M3_MAX = 448.0
QSA_ROW_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return type(t).__name__


def to_cache_dtype(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # x: [...] fp32 -> [...] out_dtype (bf16: RNE; fp8 e4m3: clamp to +-448, then RNE, scale 1.0)
    if out_dtype == torch.bfloat16:
        return x.to(torch.bfloat16)
    if out_dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
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


def check_compress_args(
    keys: torch.Tensor, first_positions: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, rotary_dim: int,
    out_dtype: torch.dtype,
) -> None:
    """Ranks, dtypes, sizes and devices of a compression (reads no tensor values)."""
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.bfloat16 or keys.dim() != 4 or keys.shape[1] < 1:
        raise ValueError(f"keys must be bf16 [G, r, H, D] with r >= 1, got {_describe(keys)}")
    num_groups, _, _, head_size = keys.shape
    if not isinstance(first_positions, torch.Tensor) or first_positions.dtype != torch.int64 \
            or tuple(first_positions.shape) != (num_groups, 3):
        raise ValueError(f"first_positions must be int64 [{num_groups}, 3], got {_describe(first_positions)}")
    if not isinstance(norm_weight, torch.Tensor) or norm_weight.dtype != torch.float32 \
            or tuple(norm_weight.shape) != (head_size,):
        raise ValueError(f"norm_weight must be fp32 [{head_size}], got {_describe(norm_weight)}")
    if first_positions.device != keys.device or norm_weight.device != keys.device:
        raise ValueError(
            f"keys, first_positions and norm_weight must share a device, got "
            f"{keys.device}, {first_positions.device}, {norm_weight.device}"
        )
    if out_dtype not in QSA_ROW_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {out_dtype}")
    if not isinstance(rotary_dim, int) or rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim!r} must be an integer <= head size D = {head_size}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


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
) -> torch.Tensor:
    # keys: [G, r, H, D] bf16; first_positions: [G, 3] int64; norm_weight: [D] fp32 -> [G, H, D] out_dtype
    check_compress_args(keys, first_positions, norm_weight, eps=eps, rotary_dim=rotary_dim, out_dtype=out_dtype)
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
    cos, sin = mrope_cos_sin(first_positions, rotary_dim=rotary_dim, theta=theta, section=section)
    rotated = apply_neox_rotary(normed.to(torch.float32), cos, sin, rotary_dim)
    return to_cache_dtype(rotated, out_dtype)
