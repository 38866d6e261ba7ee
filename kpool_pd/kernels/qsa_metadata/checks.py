"""Argument checks of the QSA per-forward metadata: the op's public entry (``kpool_pd.kernels.qsa_metadata``) runs them before
either implementation (ValueError/TypeError naming the values; the convention is ``kpool_pd.kernels.checks``'s).
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor


def check_metadata_args(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, ring_blocks: torch.Tensor,
    compress_ratio: int, ring_capacity: int, block_size: int,
) -> None:
    """Parameters, ranks, dtypes, sizes and devices (reads no tensor values: no host sync)."""
    params = (("compress_ratio", compress_ratio), ("ring_capacity", ring_capacity), ("block_size", block_size))
    for name, value in params:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if block_size % compress_ratio:
        raise ValueError(f"block_size {block_size} is not a multiple of compress_ratio {compress_ratio}")
    if ring_capacity < compress_ratio:
        raise ValueError(
            f"ring_capacity {ring_capacity} < compress_ratio {compress_ratio}: the ring cannot hold an open group"
        )
    check_int_tensor("query_start_loc", query_start_loc, 1)
    check_int_tensor("seq_lens", seq_lens, 1)
    check_int_tensor("block_table", block_table, 2)
    check_int_tensor("ring_blocks", ring_blocks, 1)
    num_requests = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_requests + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries, expected B + 1 = {num_requests + 1}")
    if block_table.shape[0] != num_requests or ring_blocks.shape[0] != num_requests:
        raise ValueError(
            f"block_table {list(block_table.shape)} and ring_blocks {list(ring_blocks.shape)} "
            f"must have B = {num_requests} rows"
        )
    for name, t in (("seq_lens", seq_lens), ("block_table", block_table), ("ring_blocks", ring_blocks)):
        if t.device != query_start_loc.device:
            raise ValueError(f"{name} is on {t.device}, query_start_loc on {query_start_loc.device}")


def check_metadata_values(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, ring_blocks: torch.Tensor,
    compress_ratio: int, block_size: int,
) -> None:
    """Offsets, lengths, ring blocks and the blocks that receive a group (reads the values: host sync)."""
    starts = query_start_loc.tolist()
    if starts[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {starts[0]}")
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    for req, q_len in enumerate(q_lens):
        if q_len < 0:
            raise ValueError(
                f"query_start_loc is not monotone: entry {req} = {starts[req]} > entry {req + 1} = {starts[req + 1]}"
            )
    max_blocks = block_table.shape[1]
    for req, (q_len, seq_len, ring_block) in enumerate(zip(q_lens, seq_lens.tolist(), ring_blocks.tolist())):
        if q_len > seq_len:
            raise ValueError(f"request {req}: q_len {q_len} > seq_len {seq_len}")
        if seq_len > max_blocks * block_size:
            raise ValueError(
                f"request {req}: seq_len {seq_len} needs {-(-seq_len // block_size)} blocks of {block_size}, "
                f"but block_table has {max_blocks} columns"
            )
        if q_len and ring_block < 0:
            raise ValueError(f"request {req}: ring block {ring_block} is negative")
    table = block_table.tolist()
    for req, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens.tolist())):
        for group in range((seq_len - q_len) // compress_ratio, seq_len // compress_ratio):
            column = group * compress_ratio // block_size
            if table[req][column] < 0:
                raise ValueError(
                    f"request {req}: block_table column {column} holds block {table[req][column]}, but group "
                    f"{group} (position {(group + 1) * compress_ratio - 1}) is written there"
                )
