"""The QSA key state ring: raw keys of each request's latest tokens, with packed MRoPE positions."""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton
from kernels.qsa_ring import ref
from kernels.qsa_ring.ref import POSITION_SLOTS, position_offset, read_qsa_ring_positions


def write_qsa_ring(ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None,
                   ring_slots: torch.Tensor) -> None:
    """Write whole ring rows (key, zeros, packed positions) in place; slot -1 skips (see ``ref``).

    Triton on CUDA tensors, the torch reference on CPU (see kernels.dispatch). Both check shapes,
    dtypes and devices; slot values (range, a row named twice) are checked on CPU tensors only, so
    the CUDA path never waits on the device: there a slot outside the ring is skipped, and two
    tokens naming one row leave either's row.

    # ring: [num_rings, C, H, W] bf16 (in place); keys: [T, H, D] bf16; positions: [T, 3] int64 | None;
    # ring_slots: [T] int64, -1 = skip
    """
    if not use_triton(ring):
        ref.write_qsa_ring(ring, keys, positions, ring_slots)
        return
    ref.check_write_args(ring, keys, positions, ring_slots)
    if not ring.is_cuda:
        ref.check_slot_values(ring_slots, ring.shape[0], ring.shape[1])
    from kernels.qsa_ring.triton import write_qsa_ring_triton

    write_qsa_ring_triton(ring, keys, positions, ring_slots)


__all__ = ["POSITION_SLOTS", "position_offset", "read_qsa_ring_positions", "write_qsa_ring"]
