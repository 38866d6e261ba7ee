"""Byte-level reads and writes of the pool that both families share: MLA entries and ring rows.

Reads gather rows for many (row, position) pairs at once and zero the invalid ones, so the
caller gets fixed-width bytes per query row.
"""

from __future__ import annotations

import torch

from kernels.mla_rows import write_mla_rows
from kvcache import CacheConfig, CachePool


def write_mla(pool: CachePool, layer: int, block_table: torch.Tensor, request: torch.Tensor,
              positions: torch.Tensor, entries: torch.Tensor) -> None:
    """Store each token's MLA entry at its position; a token whose position is negative or lies past its
    request's blocks (a padded batch's extra tokens) writes nothing. No host synchronisation.

    # block_table: [B, M] int32; request, positions: [T] int64; entries: [T, E] uint8
    """
    block_size = pool.config.block_size
    column = torch.where(positions >= 0, positions, 0) // block_size
    inside = (positions >= 0) & (column < block_table.shape[1])
    blocks = block_table.to(torch.int64)[request, torch.where(inside, column, 0)]
    write_mla_rows(pool.mla(layer), torch.where(inside, blocks, -1), positions % block_size, entries)


def read_mla(pool: CachePool, layer: int, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """MLA bytes of positions (-1 = none: zeros).

    # block_table: [Q, M] int32 (each row's table); positions: [Q, N] int64 -> [Q, N, H * E] uint8
    """
    block_size = pool.config.block_size
    valid = positions >= 0
    safe = torch.where(valid, positions, 0)
    blocks = torch.gather(block_table.to(torch.int64), 1, safe // block_size)
    valid = valid & (blocks >= 0)
    entries = pool.mla(layer)[torch.where(valid, blocks, 0), safe % block_size]  # [Q, N, H, E]
    entries = entries.reshape(*positions.shape, -1)
    return torch.where(valid[..., None], entries, torch.zeros((), dtype=torch.uint8, device=entries.device))


def read_ring_rows(pool: CachePool, layer: int, ring_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One layer's ring rows (kpool: K then gate; QSA: key row with packed positions) of positions
    (-1 = none: zeros).

    # ring_ids: [Q] int; positions: [Q, N] int64 -> [Q, N, ring_row_bytes] uint8
    """
    layout = pool.layout
    offset = layout.layer(layer).ring_row_offset
    slots = pool.rings.view(pool.num_rings, layout.ring_slots, layout.ring_slot_bytes)
    valid = positions >= 0
    slot = torch.where(valid, positions, 0) % layout.ring_slots
    rows = slots[ring_ids.to(torch.int64)[:, None], slot, offset:offset + layout.ring_row_bytes]
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=torch.uint8, device=rows.device))


def open_positions(config: CacheConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """Positions of each row's open pool (group) of g = ``config.tokens_per_entry`` tokens:
    [open_entry_start(L), L), -1 padded to g - 1.

    # seq_lens: [Q] int -> [Q, g - 1] int64
    """
    group = config.tokens_per_entry
    seq = seq_lens.to(torch.int64)[:, None]
    pos = config.open_entry_start(seq) + torch.arange(max(group - 1, 0), device=seq_lens.device)[None]
    return torch.where(pos < seq, pos, -1)
