"""One forward's QSA cache update (prefill chunk or decode step with drafts alike)."""

from __future__ import annotations

import torch

from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.qsa_update.checks import check_update_args, check_update_values
from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata
from kpool_pd.kernels.qsa_rope.cache import RopeCache, check_rope_cache
from kpool_pd.kernels.qsa_update import ref


@on_tensor_device
def qsa_forward_update(
    keys: torch.Tensor, positions: torch.Tensor, metadata: QsaMetadata, ring: torch.Tensor, compressed: torch.Tensor,
    norm_weight: torch.Tensor, *, compress_ratio: int, block_size: int, eps: float, rotary_dim: int, theta: float,
    section: tuple[int, int, int], cache_rope_positions: bool, rope_cache: RopeCache | None = None,
) -> None:
    """Write the compressed rows of every group this forward completes, then its ring rows (see ``ref``).

    ``rope_cache``: the rotary's cos/sin table by position (``kpool_pd.kernels.qsa_rope.RopeCache``, built once on the
    keys' device for this ``rotary_dim`` and ``theta``); the groups whose first position it holds read their
    cos/sin from it instead of computing them (the same bytes either way; on CUDA the computed cos/sin of an
    angle above about 1e5 are the dearest step of a group). Without one, every cos/sin is computed.

    Triton on CUDA tensors (one launch a decode step, two a prefill forward; no host synchronisation,
    CUDA-graph capturable), the torch reference on CPU (see kernels.dispatch). Both paths check types, ranks, dtypes, sizes and devices;
    the values (rings and compressed rows that exist, no row written twice) are checked on CPU tensors
    only, before anything is written. Called once per layer per forward; not idempotent.

    # keys: [T, H, D] bf16; positions: [T, 3] int64; ring: [num_rings, C, H, W] bf16 (in place);
    # compressed: [num_blocks, block_size / r, H, D] bf16 | fp8_e4m3 (in place, any strides); norm_weight: [D] fp32
    """
    check_update_args(keys, positions, metadata, ring, compressed, norm_weight, compress_ratio, block_size,
                      rotary_dim, section, cache_rope_positions)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    check_rope_cache(rope_cache, rotary_dim=rotary_dim, theta=theta, device=keys.device)
    if not keys.is_cuda:
        check_update_values(metadata, ring, compressed)
    if not use_triton(keys):
        ref.qsa_forward_update(keys, positions, metadata, ring, compressed, norm_weight,
                               compress_ratio=compress_ratio, block_size=block_size, eps=eps, rotary_dim=rotary_dim,
                               theta=theta, section=section, cache_rope_positions=cache_rope_positions,
                               rope_cache=rope_cache)
        return
    from kpool_pd.kernels.qsa_update.triton import qsa_forward_update_triton

    qsa_forward_update_triton(keys, positions, metadata, ring, compressed, norm_weight, eps=eps,
                              rotary_dim=rotary_dim, theta=theta, section=tuple(section),
                              cache_rope_positions=cache_rope_positions, rope_cache=rope_cache)


__all__ = ["qsa_forward_update"]
