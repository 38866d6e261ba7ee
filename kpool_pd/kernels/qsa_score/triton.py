"""Triton QSA scoring + top-k.

One program per (query, BLOCK_N candidate rows): for each kv head the rows are read from their
pages (bf16, or fp8 decoded on the bits; both exact in bf16), the logits ``q_h . k_j`` of the
query heads that read that kv head come from one bf16 matrix product with fp32 accumulation
(interpreted runs multiply in fp32 instead: the interpreter's bf16 products are not trustworthy),
and ``score_j = (sum_h relu(logit_hj)) / fp32(sqrt(D))``. Rows past the query's complete ones, or
whose block is -1 or past the cache, score -inf. The top-k is a stable descending sort of the
[B, M * rows] scores on the device (ties to the lower row), so nothing waits on the host.

The products are exact, but their sum runs in the matrix unit's order rather than torch's, so
scores agree with the reference to fp32 accumulation error, not bit for bit; rows whose scores are
that close may swap places.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.dispatch import interpreting
from kpool_pd.kernels.triton_helpers import bf16_bits_to_f32, decode_e4m3

BLOCK_N = 64


@triton.jit
def _score_kernel(q_ptr, comp_ptr, table_ptr, seq_ptr, scores_ptr, q_heads, kv_heads, group, table_stride,
                  table_width, num_blocks, comp_block_stride, comp_row_stride, comp_head_stride, max_rows, sqrt_d,
                  R: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, G_P2: tl.constexpr,
                  FP8: tl.constexpr, BLOCK_N: tl.constexpr, TENSOR_CORES: tl.constexpr):
    # q: [B, Hq, D] int16 (bf16 bits, contiguous); compressed: [num_blocks, ROWS, H, D] int16 | uint8; scores: [B, max_rows]
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    visible = tl.load(seq_ptr + b).to(tl.int64) // R
    column = rows // ROWS
    block = tl.load(table_ptr + b * table_stride + column, mask=(rows < visible) & (column < table_width),
                    other=-1).to(tl.int64)
    valid = (rows < visible) & (block >= 0) & (block < num_blocks)
    row_base = tl.where(valid, block * comp_block_stride + (rows % ROWS) * comp_row_stride, 0)
    cols = tl.arange(0, D_P2)
    heads = tl.arange(0, G_P2)
    total = tl.zeros((BLOCK_N,), tl.float32)
    for kv in range(kv_heads):
        bits = tl.load(comp_ptr + (row_base + kv * comp_head_stride)[:, None] + cols[None, :],
                       mask=valid[:, None] & (cols < D)[None, :], other=0)
        if FP8:
            keys = decode_e4m3(bits)
        else:
            keys = bf16_bits_to_f32(bits)
        q_rows = b * q_heads + kv * group + heads
        q_bits = tl.load(q_ptr + q_rows[:, None] * D + cols[None, :],
                         mask=(heads < group)[:, None] & (cols < D)[None, :], other=0)
        q = bf16_bits_to_f32(q_bits)
        if TENSOR_CORES:
            logits = tl.dot(q.to(tl.bfloat16), tl.trans(keys.to(tl.bfloat16)))  # [G_P2, BLOCK_N] fp32
        else:
            logits = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)
        total += tl.sum(tl.where((heads < group)[:, None], tl.maximum(logits, 0.0), 0.0), axis=0)
    score = tl.math.div_rn(total, tl.full((BLOCK_N,), sqrt_d, tl.float32))
    tl.store(scores_ptr + b * max_rows + rows, tl.where(valid, score, float("-inf")), mask=rows < max_rows)


def qsa_scores_triton(q: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      *, compress_ratio: int, block_size: int) -> torch.Tensor:
    """# -> scores: [B, M * rows] fp32 (row j of each query; -inf past its complete rows)"""
    num_queries, q_heads, head_size = q.shape
    num_blocks, rows_per_block, kv_heads, _ = compressed.shape
    max_rows = block_table.shape[1] * rows_per_block
    scores = torch.empty(num_queries, max_rows, dtype=torch.float32, device=q.device)
    if num_queries == 0 or max_rows == 0:
        return scores
    assert compressed.stride(3) == 1 and block_table.stride(1) == 1, "rows and table rows must be contiguous"
    fp8 = compressed.dtype == torch.float8_e4m3fn
    group = q_heads // kv_heads
    block_n = BLOCK_N if q.is_cuda else 16
    _score_kernel[(num_queries, triton.cdiv(max_rows, block_n))](
        q.contiguous().view(torch.int16), compressed.view(torch.uint8 if fp8 else torch.int16), block_table,
        seq_lens, scores, q_heads, kv_heads, group, block_table.stride(0), block_table.shape[1], num_blocks,
        compressed.stride(0), compressed.stride(1), compressed.stride(2), max_rows, math.sqrt(head_size),
        R=compress_ratio, ROWS=rows_per_block, D=head_size, D_P2=max(16, triton.next_power_of_2(head_size)),
        G_P2=max(16, triton.next_power_of_2(group)), FP8=fp8, BLOCK_N=block_n, TENSOR_CORES=not interpreting(),
        num_warps=4,
    )
    return scores


def qsa_topk_triton(q: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                    compress_ratio: int, block_size: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """# -> rows: [B, topk] int64, token_indices: [B, topk * r + r - 1] int64 (the reference's format)"""
    r = compress_ratio
    device = q.device
    num_queries = q.shape[0]
    scores = qsa_scores_triton(q, compressed, block_table, seq_lens, compress_ratio=r, block_size=block_size)
    width = scores.shape[1]
    visible = seq_lens.to(torch.int64) // r  # [B]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # ties: lower row first
    chosen = torch.full((num_queries, topk), -1, dtype=torch.int64, device=device)
    take = min(topk, width)
    chosen[:, :take] = order[:, :take]
    num_chosen = torch.clamp(visible, max=topk)  # [B]
    rank = torch.arange(topk, device=device)
    chosen = torch.where(rank[None, :] < num_chosen[:, None], chosen, -1)

    # Token positions: the chosen rows' r tokens each (compacted, they come first), then the open group.
    col = torch.arange(topk * r + r - 1, device=device)[None, :]
    row_tokens = chosen[:, :, None] * r + torch.arange(r, device=device)  # [B, topk, r]
    row_tokens = torch.cat([row_tokens.flatten(1), row_tokens.new_full((num_queries, r - 1), -1)], dim=1)
    num_row_tokens = (num_chosen * r)[:, None]
    open_token = visible[:, None] * r + (col - num_row_tokens)
    num_open = (seq_lens.to(torch.int64) % r)[:, None]
    token_indices = torch.where(col < num_row_tokens, row_tokens,
                                torch.where(col < num_row_tokens + num_open, open_token, -1))
    return chosen, token_indices
