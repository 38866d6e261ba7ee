"""Argument checks of the QSA key state ring (write and read-back): the op's public entry (``kpool_pd.kernels.qsa_ring``) runs them before
either implementation (ValueError/TypeError naming the values; the convention is ``kpool_pd.kernels.checks``'s).
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor, describe
from kpool_pd.kernels.qsa_ring.ref import POSITION_SLOTS, position_offset


def check_ring(ring: torch.Tensor) -> None:
    if not isinstance(ring, torch.Tensor) or ring.dtype != torch.bfloat16 or ring.dim() != 4:
        raise ValueError(f"ring must be bf16 [num_rings, C, H, W], got {describe(ring)}")
    if ring.stride(-1) != 1:
        raise ValueError(f"ring rows must be contiguous in their last dim, got strides {ring.stride()}")


def check_write_args(
    ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None, ring_slots: torch.Tensor,
) -> None:
    """Ranks, dtypes, sizes and devices of a ring write (reads no tensor values: no host sync)."""
    check_ring(ring)
    num_rings, capacity, num_heads, width = ring.shape
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.bfloat16 or keys.dim() != 3 \
            or keys.shape[1] != num_heads:
        raise ValueError(f"keys must be bf16 [T, H={num_heads}, D], got {describe(keys)}")
    num_tokens, _, head_size = keys.shape
    if head_size > width:
        raise ValueError(f"ring rows are {width} wide, too narrow for keys of head size D = {head_size}")
    check_int_tensor("ring_slots", ring_slots, 1)
    if ring_slots.shape[0] != num_tokens:
        raise ValueError(f"ring_slots must be [{num_tokens}] (one per token), got {describe(ring_slots)}")
    off = position_offset(head_size)
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 \
                or tuple(positions.shape) != (num_tokens, 3):
            raise ValueError(f"positions must be int64 [{num_tokens}, 3], got {describe(positions)}")
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


def check_read_args(ring: torch.Tensor, ring_id: int, slots: torch.Tensor, head_size: int | None) -> None:
    """Ranks, dtypes and ranges of a read of packed positions (reads the slot values: host sync)."""
    check_ring(ring)
    num_rings, capacity, _, width = ring.shape
    if not isinstance(ring_id, int) or not 0 <= ring_id < num_rings:
        raise ValueError(f"ring_id {ring_id!r} out of range [0, {num_rings})")
    check_int_tensor("slots", slots, 1)
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
