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


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return type(t).__name__


def _check_ring(ring: torch.Tensor) -> None:
    if not isinstance(ring, torch.Tensor) or ring.dtype != torch.bfloat16 or ring.dim() != 4:
        raise ValueError(f"ring must be bf16 [num_rings, C, H, W], got {_describe(ring)}")
    if ring.stride(-1) != 1:
        raise ValueError(f"ring rows must be contiguous in their last dim, got strides {ring.stride()}")


def check_write_args(
    ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None, ring_slots: torch.Tensor,
) -> None:
    """Ranks, dtypes, sizes and devices of a ring write (reads no tensor values: no host sync)."""
    _check_ring(ring)
    num_rings, capacity, num_heads, width = ring.shape
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.bfloat16 or keys.dim() != 3 \
            or keys.shape[1] != num_heads:
        raise ValueError(f"keys must be bf16 [T, H={num_heads}, D], got {_describe(keys)}")
    num_tokens, _, head_size = keys.shape
    if head_size > width:
        raise ValueError(f"ring rows are {width} wide, too narrow for keys of head size D = {head_size}")
    if not isinstance(ring_slots, torch.Tensor) or ring_slots.dtype != torch.int64 \
            or tuple(ring_slots.shape) != (num_tokens,):
        raise ValueError(f"ring_slots must be int64 [{num_tokens}], got {_describe(ring_slots)}")
    off = position_offset(head_size)
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 \
                or tuple(positions.shape) != (num_tokens, 3):
            raise ValueError(f"positions must be int64 [{num_tokens}, 3], got {_describe(positions)}")
        if width != off + POSITION_SLOTS:
            raise ValueError(
                f"ring rows are {width} wide, but cached positions need W = off + 12 = "
                f"{off + POSITION_SLOTS} (head size {head_size}, off = ceil(D / 4) * 4 = {off})"
            )
    for name, t in (("keys", keys), ("ring_slots", ring_slots), ("positions", positions)):
        if t is not None and t.device != ring.device:
            raise ValueError(f"{name} is on {t.device}, the ring on {ring.device}")


def check_slot_values(ring_slots: torch.Tensor, num_rings: int, capacity: int) -> None:
    """Every slot is -1 or a row of the ring, and no row is named twice (reads the values: host sync)."""
    out_of_range = (ring_slots < -1) | (ring_slots >= num_rings * capacity)
    if bool(out_of_range.any()):
        raise ValueError(
            f"ring_slots {ring_slots[out_of_range].tolist()} out of range: "
            f"-1 (skip) or [0, num_rings * C = {num_rings * capacity})"
        )
    slots = ring_slots[ring_slots >= 0]
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"ring_slots name one row twice in one write: {slots.tolist()}")


def write_qsa_ring(
    ring: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor | None,
    ring_slots: torch.Tensor,
) -> None:
    # ring: [num_rings, C, H, W] bf16 (written in place); keys: [T, H, D] bf16;
    # positions: [T, 3] int64 or None (no cached positions); ring_slots: [T] int64, -1 = skip
    check_write_args(ring, keys, positions, ring_slots)
    num_rings, capacity, num_heads, width = ring.shape
    head_size = keys.shape[2]
    off = position_offset(head_size)
    check_slot_values(ring_slots, num_rings, capacity)
    valid = ring_slots >= 0
    slots = ring_slots[valid]

    # Build the full rows as int16 bit patterns, then scatter them.
    rows = torch.zeros(slots.numel(), num_heads, width, dtype=torch.int16, device=ring.device)
    rows[:, :, :head_size] = keys[valid].view(torch.int16)
    if positions is not None:
        packed = positions[valid].contiguous().view(torch.int16)  # [n, 12]
        rows[:, :, off:off + POSITION_SLOTS] = packed[:, None, :]
    ring.view(torch.int16)[slots // capacity, slots % capacity] = rows


def read_qsa_ring_positions(
    ring: torch.Tensor, ring_id: int, slots: torch.Tensor, *, head_size: int | None = None
) -> torch.Tensor:
    # ring: [num_rings, C, H, W] bf16; slots: [n] int64 rows of ring `ring_id` (pos % C) -> [n, 3] int64
    """The packed positions of rows ``slots`` of ring ``ring_id`` (read from head 0).

    A ring with cached positions has rows ``W = off + 12`` wide, so the positions are the
    row's last 12 slots. ``head_size`` (D), when given, is checked against that width; a
    ring without cached positions cannot be told apart by its shape alone.
    """
    _check_ring(ring)
    num_rings, capacity, _, width = ring.shape
    if not isinstance(ring_id, int) or not 0 <= ring_id < num_rings:
        raise ValueError(f"ring_id {ring_id!r} out of range [0, {num_rings})")
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError(f"slots must be a 1-D int64 tensor, got {_describe(slots)}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise ValueError(f"slots {slots.tolist()} out of range [0, C = {capacity})")
    off = width - POSITION_SLOTS
    if head_size is not None and position_offset(head_size) != off:
        raise ValueError(
            f"ring rows are {width} wide, but cached positions for head size {head_size} need "
            f"W = off + 12 = {position_offset(head_size) + POSITION_SLOTS}"
        )
    if off < 0:
        raise ValueError(f"ring rows are {width} wide: too narrow to hold 12 position slots")
    packed = ring.view(torch.int16)[ring_id, slots.to(ring.device), 0, off:off + POSITION_SLOTS]
    return packed.contiguous().view(torch.int64)
