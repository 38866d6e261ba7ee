"""QSA top-k selection over the compressed key cache (plain torch).

For each query (one row of ``q`` with the sequence length it sees), every visible complete
compressed row ``j < seq_len // r`` gets

    score_j = (sum_h relu(q_h . k_{j, h // (Hq / H)})) / sqrt(D)

in fp32: the bf16 query and the cached row (bf16, or fp8 dequantized with scale 1.0) are
widened to fp32, each dot product is torch's fp32 sum over D of the elementwise products,
the relu'd heads are summed by torch over the query heads, and the sum is divided by
``fp32(sqrt(D))``. Query head ``h`` reads kv head ``h // (Hq / H)`` (grouped queries).

The top ``topk`` rows by score descending are chosen, ties broken by the lower row index
(a stable sort), so the choice is deterministic.

Returned format (every row of a query is -1 padded at its end):

* ``rows: [B, topk] int64``: the chosen row indices in rank order (best first); a query
  with fewer than ``topk`` visible rows has its remaining entries -1.
* ``token_indices: [B, topk * r + r - 1] int64``: the token positions to attend to,
  compacted: each chosen row's ``r`` positions ``j*r .. j*r + r - 1`` in rank order, then the
  open group's positions ``(seq_len // r) * r .. seq_len - 1`` (always included), then -1.
  The number of valid entries is ``min(topk, seq_len // r) * r + seq_len % r``.
"""

from __future__ import annotations

import math

import torch


def qsa_topk(
    q: torch.Tensor,
    compressed: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    compress_ratio: int,
    block_size: int,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [B, Hq, D] bf16; compressed: [num_blocks, block_size / r, H, D] bf16 | fp8_e4m3 (any strides);
    # block_table: [B, M] int32; seq_lens: [B] int32 -> rows: [B, topk] int64, token_indices: [B, topk*r + r-1] int64
    """Top-k compressed rows per query and the token positions they expand to (module docstring).

    One row of ``q`` per query token; ``seq_lens[b]`` is the number of tokens that query sees
    (its position + 1), so a decode step's drafts are separate rows with their own lengths.
    """
    r = compress_ratio
    rows_per_block = block_size // r
    device = q.device
    num_queries, num_q_heads, head_size = q.shape
    num_blocks, _, num_kv_heads, _ = compressed.shape

    visible = seq_lens.to(torch.int64) // r  # [B] complete rows per query
    max_rows = int(visible.max()) if num_queries else 0
    row = torch.arange(max_rows, device=device)  # [J]
    is_visible = row[None, :] < visible[:, None]  # [B, J]

    # Gather every query's candidate rows; invisible ones read block 0 and are masked out.
    block_col = ((row * r) // block_size).clamp(max=max(block_table.shape[1] - 1, 0))
    block_id = torch.where(is_visible, block_table.to(torch.int64)[:, block_col], 0)  # [B, J]
    bits = torch.int16 if compressed.dtype == torch.bfloat16 else torch.uint8
    k = compressed.view(bits)[block_id, (row % rows_per_block)[None, :].expand_as(block_id)]  # [B, J, H, D]
    k = k.view(compressed.dtype).to(torch.float32)
    k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=2)  # [B, J, Hq, D]: query head h reads kv head h // group

    dots = (q.to(torch.float32)[:, None] * k).sum(dim=-1)  # [B, J, Hq]
    # A true fp32 division on every device (a CPU scalar divisor may become a reciprocal multiply).
    sqrt_d = torch.tensor(math.sqrt(head_size), dtype=torch.float32, device=device)
    scores = torch.relu(dots).sum(dim=-1) / sqrt_d  # [B, J]
    scores = torch.where(is_visible, scores, -math.inf)

    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # ties: lower row first
    chosen = torch.full((num_queries, topk), -1, dtype=torch.int64, device=device)
    take = min(topk, max_rows)
    chosen[:, :take] = order[:, :take]
    num_chosen = torch.minimum(visible, torch.tensor(topk, device=device))  # [B]
    rank = torch.arange(topk, device=device)
    chosen = torch.where(rank[None, :] < num_chosen[:, None], chosen, -1)

    # Token positions: the chosen rows' r tokens each (compacted, they come first), then the open group.
    width = topk * r + r - 1
    col = torch.arange(width, device=device)[None, :]  # [1, width]
    row_tokens = chosen[:, :, None] * r + torch.arange(r, device=device)  # [B, topk, r]
    row_tokens = torch.cat([row_tokens.flatten(1), row_tokens.new_full((num_queries, r - 1), -1)], dim=1)
    num_row_tokens = (num_chosen * r)[:, None]
    open_token = visible[:, None] * r + (col - num_row_tokens)
    num_open = (seq_lens.to(torch.int64) % r)[:, None]
    token_indices = torch.where(
        col < num_row_tokens,
        row_tokens,
        torch.where(col < num_row_tokens + num_open, open_token, -1),
    )
    return chosen, token_indices
