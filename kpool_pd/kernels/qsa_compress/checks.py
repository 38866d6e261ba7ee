"""Argument checks of compression of complete QSA groups: the op's public entry (``kpool_pd.kernels.qsa_compress``) runs them before
either implementation (ValueError/TypeError naming the values; the convention is ``kpool_pd.kernels.checks``'s).
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import describe
from kpool_pd.kernels.qsa_compress.ref import QSA_ROW_DTYPES


def check_compress_args(
    keys: torch.Tensor, first_positions: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, rotary_dim: int,
    out_dtype: torch.dtype,
) -> None:
    """Ranks, dtypes, sizes and devices of a compression (reads no tensor values)."""
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.bfloat16 or keys.dim() != 4 or keys.shape[1] < 1:
        raise ValueError(f"keys must be bf16 [G, r, H, D] with r >= 1, got {describe(keys)}")
    num_groups, _, _, head_size = keys.shape
    if not isinstance(first_positions, torch.Tensor) or first_positions.dtype != torch.int64 \
            or tuple(first_positions.shape) != (num_groups, 3):
        raise ValueError(f"first_positions must be int64 [{num_groups}, 3], got {describe(first_positions)}")
    if not isinstance(norm_weight, torch.Tensor) or norm_weight.dtype != torch.float32 \
            or tuple(norm_weight.shape) != (head_size,):
        raise ValueError(f"norm_weight must be fp32 [{head_size}], got {describe(norm_weight)}")
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
