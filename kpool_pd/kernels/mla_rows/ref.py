"""Reference of the MLA row write: each token's entry into its (block, offset) row, every head alike."""

from __future__ import annotations

import torch


def write_rows(mla: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, entries: torch.Tensor) -> None:
    """Store each token's entry at ``mla[block, offset, h]`` for every head h; block -1 skips the token.

    # mla: [num_blocks, N, H, C] uint8 (any strides); blocks, offsets: [T] int; entries: [T, C] uint8
    """
    live = blocks >= 0
    mla[blocks[live].to(torch.int64), offsets[live].to(torch.int64)] = entries[live][:, None, :]
