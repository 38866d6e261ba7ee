"""Reference paged write and read of kpool indexer entries (DeepGEMM paged-MQA page layout).

An entry's slot is ``block_id * S + state``; slot -1 is skipped. A block's S states lie in kernel
pages of ``states_per_page`` entries: state s is entry ``s % states_per_page`` of page
``s // states_per_page`` (``page_index``, the one place the reference says so; the Triton kernels'
``entry_offsets`` is its twin).
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.fp8 import dequantize_fp8_rows


def block_states(indexer_q: torch.Tensor) -> int:
    """S, the states of one block: pages * states_per_page.

    # indexer_q: [num_blocks, pages, states_per_page, 128]
    """
    return indexer_q.shape[1] * indexer_q.shape[2]


def page_index(slots: torch.Tensor, indexer_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each slot's entry lives: (block, kernel page, entry in the page).

    # slots: [P] int64 >= 0; indexer_q: [num_blocks, pages, states_per_page, 128] -> three [P] int64
    """
    states, per_page = block_states(indexer_q), indexer_q.shape[2]
    block, state = slots // states, slots % states
    return block, state // per_page, state % per_page


def write_entries(
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor
) -> None:
    """# indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages,
    #   states_per_page] fp32 (views of the pool); q: [P, 128] fp8; scale: [P] fp32; slots: [P] int, -1 = skip
    """
    keep = slots >= 0
    where = page_index(slots[keep].to(torch.int64), indexer_q)
    indexer_q[where] = q[keep]
    indexer_scale[where] = scale[keep]


def read_entries(
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw entries back.

    # slots: [P] int (>= 0) -> q: [P, 128] fp8, scale: [P] fp32
    """
    where = page_index(slots.to(torch.int64), indexer_q)
    return indexer_q[where], indexer_scale[where]


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
