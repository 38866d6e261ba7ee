"""Reference paged write and read of kpool indexer entries (DeepGEMM paged-MQA page layout).

An entry's slot is ``block_id * S + state``; slot -1 is skipped.
"""

from __future__ import annotations

import torch

from kernels.fp8 import dequantize_fp8_rows


def write_entries(
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor
) -> None:
    """# indexer_q: [num_blocks, S, 128] fp8; indexer_scale: [num_blocks, S] fp32 (views of the pool)
    # q: [P, 128] fp8; scale: [P] fp32; slots: [P] int, -1 = skip
    """
    states = indexer_q.shape[1]
    keep = slots >= 0
    live = slots[keep].to(torch.int64)
    blocks, state = live // states, live % states
    indexer_q[blocks, state] = q[keep]
    indexer_scale[blocks, state] = scale[keep]


def read_entries(
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw entries back.

    # slots: [P] int (>= 0) -> q: [P, 128] fp8, scale: [P] fp32
    """
    states = indexer_q.shape[1]
    slots = slots.to(torch.int64)
    return indexer_q[slots // states, slots % states], indexer_scale[slots // states, slots % states]


def pool_slots(block_table: torch.Tensor, pools: torch.Tensor, *, kpool: int, states: int) -> torch.Tensor:
    """Slot of pool p of each row: block_table[row, p*kpool // block_size] * S + p % S (-1 where the
    block table holds -1 or is too short).

    # block_table: [B, M] int; pools: [B, N] int64 (pool indices, -1 = none) -> [B, N] int64
    """
    block_size = kpool * states
    column = torch.where(pools >= 0, pools * kpool // block_size, 0)
    in_table = column < block_table.shape[1]
    block = torch.gather(block_table.to(torch.int64), 1, column.clamp(max=block_table.shape[1] - 1))
    valid = (pools >= 0) & in_table & (block >= 0)
    return torch.where(valid, block * states + pools % states, -1)


def dequantize_entries(indexer_q: torch.Tensor, indexer_scale: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """# slots: [P] int (>= 0) -> [P, 128] fp32"""
    q, scale = read_entries(indexer_q, indexer_scale, slots)
    return dequantize_fp8_rows(q, scale)
