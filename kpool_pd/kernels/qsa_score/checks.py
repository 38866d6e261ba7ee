"""Argument checks of the QSA top-k selection: the op's public entry (``kpool_pd.kernels.qsa_score``) runs them before
either implementation (ValueError/TypeError naming the values; the convention is ``kpool_pd.kernels.checks``'s).
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor, describe
from kpool_pd.kernels.qsa_compress.ref import QSA_ROW_DTYPES


def check_topk_args(
    q: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    compress_ratio: int, block_size: int, topk: int,
) -> None:
    """Parameters, ranks, dtypes, sizes and devices (reads no tensor values: no host sync)."""
    for name, value in (("compress_ratio", compress_ratio), ("block_size", block_size), ("topk", topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if block_size % compress_ratio:
        raise ValueError(f"block_size {block_size} is not a multiple of compress_ratio {compress_ratio}")
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3:
        raise ValueError(f"q must be bf16 [B, Hq, D], got {describe(q)}")
    num_queries, num_q_heads, head_size = q.shape
    rows_per_block = block_size // compress_ratio
    if not isinstance(compressed, torch.Tensor) or compressed.dtype not in QSA_ROW_DTYPES \
            or compressed.dim() != 4 or compressed.shape[1] != rows_per_block or compressed.shape[3] != head_size:
        raise ValueError(
            f"compressed must be bf16 or fp8_e4m3 [num_blocks, rows={rows_per_block}, H, D={head_size}], "
            f"got {describe(compressed)}"
        )
    num_kv_heads = compressed.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads Hq = {num_q_heads} is not a multiple of the cache's kv heads H = {num_kv_heads}")
    check_int_tensor("seq_lens", seq_lens, 1)
    check_int_tensor("block_table", block_table, 2)
    if seq_lens.shape[0] != num_queries or block_table.shape[0] != num_queries:
        raise ValueError(f"seq_lens [{num_queries}] and block_table [{num_queries}, M] need one row per query, got "
                         f"{describe(seq_lens)} and {describe(block_table)}")
    for name, t in (("compressed", compressed), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def check_topk_values(
    compressed: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, compress_ratio: int, block_size: int,
) -> None:
    """Sequence lengths within the tables, visible rows in existing blocks (reads the values: host sync)."""
    max_blocks = block_table.shape[1]
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len < 0 or seq_len > max_blocks * block_size:
            raise ValueError(
                f"query {b}: seq_len {seq_len} must be in [0, {max_blocks * block_size}] "
                f"(block_table has {max_blocks} columns of {block_size} tokens)"
            )
    r = compress_ratio
    num_blocks = compressed.shape[0]
    visible = seq_lens.to(torch.int64) // r
    max_rows = int(visible.max()) if seq_lens.numel() else 0
    row = torch.arange(max_rows, device=seq_lens.device)
    is_visible = row[None, :] < visible[:, None]
    block_col = ((row * r) // block_size).clamp(max=max(max_blocks - 1, 0))
    block_id = torch.where(is_visible, block_table.to(torch.int64)[:, block_col], 0)
    bad = torch.nonzero((block_id < 0) | (block_id >= num_blocks))
    if bad.numel():
        b, j = bad[0].tolist()
        raise ValueError(
            f"query {b}: visible row {j} lives in block_table column {int(block_col[j])} = block "
            f"{int(block_id[b, j])}, outside the cache's blocks [0, {num_blocks})"
        )
