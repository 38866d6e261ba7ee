"""Compression of complete QSA groups into normed, group-first-RoPE rows (bf16 or fp8)."""

from __future__ import annotations

import torch

from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.qsa_compress.checks import check_compress_args
from kpool_pd.kernels.qsa_compress import ref
from kpool_pd.kernels.qsa_rope.cache import RopeCache, check_rope_cache
from kpool_pd.kernels.qsa_rope.ref import mrope_axis_of_pair


@on_tensor_device
def compress_group_keys(
    keys: torch.Tensor, first_positions: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, rotary_dim: int,
    theta: float, section: tuple[int, int, int], out_dtype: torch.dtype, rope_cache: RopeCache | None = None,
) -> torch.Tensor:
    """Compress G complete groups (see ``ref``): Triton on CUDA tensors, the torch reference on CPU. Both paths
    check the arguments first (``kpool_pd.kernels.qsa_compress.checks``). ``rope_cache``: as in ``kpool_pd.kernels.qsa_update``, the cos/sin
    table by position that the positions it holds are read from (the same bytes).

    # keys: [G, r, H, D] bf16; first_positions: [G, 3] int64; norm_weight: [D] fp32 -> [G, H, D] out_dtype
    """
    check_compress_args(keys, first_positions, norm_weight, eps=eps, rotary_dim=rotary_dim,
                        out_dtype=out_dtype)
    mrope_axis_of_pair(rotary_dim, section)  # checks the rotary parameters
    check_rope_cache(rope_cache, rotary_dim=rotary_dim, theta=theta, device=keys.device)
    if not use_triton(keys):
        return ref.compress_group_keys(keys, first_positions, norm_weight, eps=eps, rotary_dim=rotary_dim,
                                       theta=theta, section=section, out_dtype=out_dtype, rope_cache=rope_cache)
    from kpool_pd.kernels.qsa_compress.triton import compress_group_keys_triton

    return compress_group_keys_triton(keys, first_positions, norm_weight, eps=eps, rotary_dim=rotary_dim,
                                      theta=theta, section=tuple(section), out_dtype=out_dtype,
                                      rope_cache=rope_cache)


__all__ = ["compress_group_keys"]
