"""Paged indexer scoring over complete pools, and top-k."""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor, check_same_device, check_tensor
from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.kpool_checks import check_indexer_page
from kpool_pd.kernels.kpool_score.ref import indexer_topk
from kpool_pd.kvcache import INDEX_HEAD_DIM


@on_tensor_device
def kpool_indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, kpool: int, topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k complete pools per request by sum_h w_h * relu(q_h . dequant(k_j)).

    Triton on CUDA tensors (scores equal to fp32 accumulation error, no host synchronisation), the torch
    reference on CPU (see kernels.dispatch).

    # q: [B, H, 128] bf16; weights: [B, H] fp32; seq_lens: [B] int; block_table: [B, M] int
    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages, states_per_page] fp32
    # -> pools: [B, topk] int64 (best first, ties to the lower index, -1 padded), scores: [B, topk] fp32
    """
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, INDEX_HEAD_DIM))
    batch, heads, _ = q.shape
    check_tensor("weights", weights, dtype=torch.float32, shape=(batch, heads))
    check_int_tensor("seq_lens", seq_lens, 1)
    check_int_tensor("block_table", block_table, 2)
    if seq_lens.shape[0] != batch or block_table.shape[0] != batch:
        raise ValueError(f"seq_lens and block_table need {batch} rows, got {seq_lens.shape[0]} and {block_table.shape[0]}")
    check_indexer_page(indexer_q, indexer_scale)
    if not isinstance(kpool, int) or kpool < 2:
        raise ValueError(f"kpool must be an integer >= 2, got {kpool!r}")
    if not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
    check_same_device(q=q, weights=weights, seq_lens=seq_lens, block_table=block_table, indexer_q=indexer_q)
    if use_triton(q):
        from kpool_pd.kernels.kpool_score.triton import indexer_topk_triton

        return indexer_topk_triton(q, weights, seq_lens, block_table, indexer_q, indexer_scale, kpool=kpool, topk=topk)
    return indexer_topk(q, weights, seq_lens, block_table, indexer_q, indexer_scale, kpool=kpool, topk=topk)
