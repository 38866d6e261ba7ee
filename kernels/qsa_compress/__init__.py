"""Compression of complete QSA groups into normed, group-first-RoPE rows (bf16 or fp8)."""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton
from kernels.qsa_compress import ref
from kernels.qsa_rope.ref import mrope_axis_of_pair


def compress_group_keys(
    keys: torch.Tensor, first_positions: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, rotary_dim: int,
    theta: float, section: tuple[int, int, int], out_dtype: torch.dtype,
) -> torch.Tensor:
    """Compress G complete groups (see ``ref``): Triton on CUDA tensors, the torch reference on CPU.

    # keys: [G, r, H, D] bf16; first_positions: [G, 3] int64; norm_weight: [D] fp32 -> [G, H, D] out_dtype
    """
    if not use_triton(keys):
        return ref.compress_group_keys(keys, first_positions, norm_weight, eps=eps, rotary_dim=rotary_dim,
                                       theta=theta, section=section, out_dtype=out_dtype)
    ref.check_compress_args(keys, first_positions, norm_weight, eps=eps, rotary_dim=rotary_dim, out_dtype=out_dtype)
    mrope_axis_of_pair(rotary_dim, section)  # the rotary parameters, as the reference checks them
    from kernels.qsa_compress.triton import compress_group_keys_triton

    return compress_group_keys_triton(keys, first_positions, norm_weight, eps=eps, rotary_dim=rotary_dim,
                                      theta=theta, section=tuple(section), out_dtype=out_dtype)


__all__ = ["compress_group_keys"]
