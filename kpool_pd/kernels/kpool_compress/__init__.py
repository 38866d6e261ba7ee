"""kpool pool compression: raw keys and gates of complete pools -> fp8 indexer entries."""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import as_pool_mode, check_same_device, check_tensor
from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.kpool_compress.ref import compress_pools
from kpool_pd.kvcache import INDEX_HEAD_DIM, PoolMode


@on_tensor_device
def kpool_compress(
    k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, *, mode: PoolMode | str = "softmax", round_scale: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress P complete pools (Triton on CUDA tensors, the torch reference on CPU; see kernels.dispatch).

    # k, gate: [P, kpool, 128] bf16; ape: [kpool, 128] fp32 -> q: [P, 128] float8_e4m3fn, scale: [P] fp32
    """
    mode = as_pool_mode(mode)
    check_tensor("k", k, dtype=torch.bfloat16, rank=3)
    pools, kpool, dim = k.shape
    if dim != INDEX_HEAD_DIM:
        raise ValueError(f"k must have head dim {INDEX_HEAD_DIM}, got shape {tuple(k.shape)}")
    if kpool < 2:
        raise ValueError(f"kpool must be >= 2, got k of shape {tuple(k.shape)}")
    check_tensor("gate", gate, dtype=torch.bfloat16, shape=(pools, kpool, dim))
    check_tensor("ape", ape, dtype=torch.float32, shape=(kpool, dim))
    check_same_device(k=k, gate=gate, ape=ape)
    if use_triton(k):
        from kpool_pd.kernels.kpool_compress.triton import compress_pools_triton

        return compress_pools_triton(k, gate, ape, mode=mode, round_scale=round_scale)
    return compress_pools(k, gate, ape, mode=mode, round_scale=round_scale)
