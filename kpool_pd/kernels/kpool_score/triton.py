"""Triton paged indexer scoring + top-k.

One program per (request, BLOCK_N pools): the pools' fp8 keys are read from their pages, the logits
q_h . k_j come from one bf16 matrix product with fp32 accumulation (fp8 codes are exact in bf16) and
are then scaled by each entry's fp32 scale, and score_j = sum_h w_h * relu(logit_hj). Pools past
the request's complete ones score -inf. The top-k is a stable sort of the [B, M*S] score rows on
the device (ties to the lower pool index), so nothing waits on the host. Triton 3.9's interpreter
multiplies bf16 tiles as raw integers, so interpreted runs take an fp32 product of the same (exact)
operands instead (TENSOR_CORES=False).

Rounding differs from the reference (which dequantizes first and sums in its matmul's order), so
scores agree to fp32 accumulation error, not bit for bit; pools whose block is -1 score -inf here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.dispatch import interpreting
from kpool_pd.kernels.kpool_cache.triton import entry_offsets, page_strides
from kpool_pd.kernels.triton_helpers import decode_e4m3

BLOCK_N = 64


@triton.jit
def _score_kernel(q_ptr, w_ptr, seq_lens_ptr, table_ptr, iq_ptr, is_ptr, scores_ptr,
                  heads, table_stride, table_width, states, block_size, iq_block, iq_page, iq_entry, is_block, is_page,
                  is_entry, max_pools, PAGE: tl.constexpr, KPOOL: tl.constexpr, HEADS_P2: tl.constexpr,
                  BLOCK_N: tl.constexpr, TENSOR_CORES: tl.constexpr):
    # q: [B, H, 128] bf16; w: [B, H] fp32; scores: [B, max_pools] fp32
    # iq: [num_blocks, states / PAGE, PAGE, 128] uint8; is: [num_blocks, states / PAGE, PAGE] fp32 (kernel pages)
    request = tl.program_id(0).to(tl.int64)
    pools = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    complete = tl.load(seq_lens_ptr + request).to(tl.int64) // KPOOL
    live = pools < complete
    column = pools * KPOOL // block_size
    block = tl.load(table_ptr + request * table_stride + column, mask=live & (column < table_width), other=-1)
    block = block.to(tl.int64)
    valid = live & (block >= 0)
    q_at, scale_at = entry_offsets(block, pools % states, PAGE, iq_block, iq_page, iq_entry, is_block, is_page,
                                   is_entry)
    dims = tl.arange(0, 128)
    codes = tl.load(iq_ptr + q_at[:, None] + dims[None, :], mask=valid[:, None], other=0)
    keys = decode_e4m3(codes)  # [BLOCK_N, 128] fp32, each value exact in bf16
    scale = tl.load(is_ptr + scale_at, mask=valid, other=0.0)
    head = tl.arange(0, HEADS_P2)
    q = tl.load(q_ptr + (request * heads + head)[:, None] * 128 + dims[None, :], mask=(head < heads)[:, None],
                other=0.0)
    w = tl.load(w_ptr + request * heads + head, mask=head < heads, other=0.0)
    if TENSOR_CORES:
        logits = tl.dot(q, tl.trans(keys.to(tl.bfloat16)))
    else:
        logits = tl.dot(q.to(tl.float32), tl.trans(keys), input_precision="ieee")
    logits = logits * scale[None, :]  # [HEADS_P2, BLOCK_N] fp32
    score = tl.sum(w[:, None] * tl.maximum(logits, 0.0), axis=0)
    score = tl.where(valid, score, float("-inf"))
    tl.store(scores_ptr + request * max_pools + pools, score, mask=pools < max_pools)


def indexer_scores_triton(q: torch.Tensor, weights: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                          indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, kpool: int) -> torch.Tensor:
    """# -> scores: [B, M*S] fp32 (pool j of each request; -inf past its complete pools)"""
    batch, heads, _ = q.shape
    page = indexer_q.shape[2]
    states = indexer_q.shape[1] * page
    max_pools = block_table.shape[1] * states
    scores = torch.empty(batch, max_pools, dtype=torch.float32, device=q.device)
    if batch == 0 or max_pools == 0:
        return scores
    assert block_table.stride(1) == 1, "table rows must be contiguous"
    _score_kernel[(batch, triton.cdiv(max_pools, BLOCK_N))](
        q.contiguous(), weights.contiguous(), seq_lens, block_table, indexer_q.view(torch.uint8), indexer_scale, scores,
        heads, block_table.stride(0), block_table.shape[1], states, kpool * states,
        *page_strides(indexer_q, indexer_scale), max_pools, PAGE=page, KPOOL=kpool,
        HEADS_P2=max(16, triton.next_power_of_2(heads)), BLOCK_N=BLOCK_N,
        TENSOR_CORES=not interpreting(), num_warps=4,
    )
    return scores


def indexer_topk_triton(q: torch.Tensor, weights: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                        indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, kpool: int,
                        topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """# -> pools: [B, topk] int64 (best first, ties to the lower index, -1 padded), scores: [B, topk] fp32"""
    scores = indexer_scores_triton(q, weights, seq_lens, block_table, indexer_q, indexer_scale, kpool=kpool)
    batch, width = scores.shape
    ordered, order = torch.sort(scores, dim=1, descending=True, stable=True)
    keep = min(topk, width)
    if keep == topk:  # the usual case: as many pools as asked for, no padding (two launches fewer)
        chosen = ordered[:, :topk]
        return torch.where(chosen == float("-inf"), -1, order[:, :topk]), chosen
    pools_out = torch.full((batch, topk), -1, dtype=torch.int64, device=q.device)
    scores_out = torch.full((batch, topk), float("-inf"), dtype=torch.float32, device=q.device)
    chosen = ordered[:, :keep]
    scores_out[:, :keep] = chosen
    pools_out[:, :keep] = torch.where(chosen == float("-inf"), -1, order[:, :keep])
    return pools_out, scores_out
