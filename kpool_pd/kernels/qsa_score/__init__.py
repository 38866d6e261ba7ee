"""QSA top-k selection over the compressed key cache."""

from __future__ import annotations

import torch

from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.qsa_score.checks import check_topk_args, check_topk_values
from kpool_pd.kernels.qsa_score import ref


@on_tensor_device
def qsa_topk(
    q: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
    compress_ratio: int, block_size: int, topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k compressed rows per query and the token positions they expand to (see ``ref``).

    Triton on CUDA tensors (scores equal to fp32 accumulation error, no host synchronisation), the torch
    reference on CPU (see kernels.dispatch). Both check ranks, dtypes, sizes and devices; sequence lengths
    and the blocks of visible rows are checked on CPU tensors only (on CUDA such rows score -inf).

    # q: [B, Hq, D] bf16; compressed: [num_blocks, block_size / r, H, D] bf16 | fp8_e4m3 (any strides);
    # block_table: [B, M] int; seq_lens: [B] int -> rows: [B, topk] int64, token_indices: [B, topk*r + r-1] int64
    """
    check_topk_args(q, compressed, block_table, seq_lens, compress_ratio, block_size, topk)
    if not q.is_cuda:
        check_topk_values(compressed, block_table, seq_lens, compress_ratio, block_size)
    if not use_triton(q):
        return ref.qsa_topk(q, compressed, block_table, seq_lens, compress_ratio=compress_ratio,
                            block_size=block_size, topk=topk)
    from kpool_pd.kernels.qsa_score.triton import qsa_topk_triton

    return qsa_topk_triton(q, compressed, block_table, seq_lens, compress_ratio=compress_ratio,
                           block_size=block_size, topk=topk)


__all__ = ["qsa_topk"]
