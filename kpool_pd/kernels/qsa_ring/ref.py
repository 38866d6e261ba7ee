"""The QSA key state ring: raw keys of a request's most recent tokens (plain torch).

Ring ``i`` (one per request) has ``C`` rows; position ``pos`` lives in row ``pos % C``, so
``ring_slots = ring_id * C + pos % C`` addresses a row of the flattened ``[num_rings * C]``
axis. Each row holds, for every kv head, a ``W``-wide bf16 vector::

    [0, D)           the raw bf16 key (before norm and rotary)
    [D, W)           without cached positions (W >= D): zeros
    [D, off)         with cached positions: zeros (off = ceil(D / 4) * 4 keeps them 8-byte aligned)
    [off, off + 12)  with cached positions (W = off + 12): the token's MRoPE (time, height,
                     width) as 3 int64, their bytes reinterpreted as 12 bf16 slots, the same
                     for every head; ``row[off:off + 12].view(torch.int64)`` reads them back

A write sets the whole row, so the ring's bytes depend only on what was written (a write
without positions into rows that have room for them zeroes those slots).
Writes and reads go through integer views, so NaN payloads and packed integers keep
their exact bits.
"""

from __future__ import annotations

import math

import torch

POSITION_SLOTS = 12  # 3 int64 = 12 bf16 slots


def position_offset(head_size: int) -> int:
    """bf16 offset of the packed positions in a ring row: ceil(D / 4) * 4."""
    return math.ceil(head_size / 4) * 4


def write_qsa_ring(
    ring: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor | None,
    ring_slots: torch.Tensor,
) -> None:
    # ring: [num_rings, C, H, W] bf16 (written in place); keys: [T, H, D] bf16;
    # positions: [T, 3] int64 or None (no cached positions); ring_slots: [T] int64, -1 = skip
    num_rings, capacity, num_heads, width = ring.shape
    head_size = keys.shape[2]
    off = position_offset(head_size)
    valid = ring_slots >= 0
    slots = ring_slots[valid]

    # Build the full rows as int16 bit patterns, then scatter them.
    rows = torch.zeros(slots.numel(), num_heads, width, dtype=torch.int16, device=ring.device)
    rows[:, :, :head_size] = keys[valid].view(torch.int16)
    if positions is not None:
        packed = positions[valid].contiguous().view(torch.int16)  # [n, 12]
        rows[:, :, off:off + POSITION_SLOTS] = packed[:, None, :]
    ring.view(torch.int16)[slots // capacity, slots % capacity] = rows


def read_qsa_ring_positions(ring: torch.Tensor, ring_id: int, slots: torch.Tensor) -> torch.Tensor:
    # ring: [num_rings, C, H, W] bf16; slots: [n] int64 rows of ring `ring_id` (pos % C) -> [n, 3] int64
    """The packed positions of rows ``slots`` of ring ``ring_id`` (read from head 0).

    A ring with cached positions has rows ``W = off + 12`` wide, so the positions are the
    row's last 12 slots (a ring without cached positions cannot be told apart by its shape alone).
    """
    off = ring.shape[3] - POSITION_SLOTS
    packed = ring.view(torch.int16)[ring_id, slots.to(ring.device), 0, off:off + POSITION_SLOTS]
    return packed.contiguous().view(torch.int64)
