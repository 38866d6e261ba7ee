"""The QSA key state ring: raw keys of each request's latest tokens, with packed MRoPE positions."""

from __future__ import annotations

import torch

from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.qsa_ring.checks import check_read_args, check_slot_values, check_write_args
from kpool_pd.kernels.qsa_ring import ref
from kpool_pd.kernels.qsa_ring.ref import POSITION_SLOTS, position_offset


@on_tensor_device
def write_qsa_ring(ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None,
                   ring_slots: torch.Tensor) -> None:
    """Write whole ring rows (key, zeros, packed positions) in place; slot -1 skips (see ``ref``).

    Triton on CUDA tensors, the torch reference on CPU (see kernels.dispatch). Both check shapes,
    dtypes and devices; slot values (range, a row named twice) are checked on CPU tensors only, so
    the CUDA path never waits on the device: there a slot outside the ring is skipped, and two
    tokens naming one row leave either's row.

    # ring: [num_rings, C, H, W] bf16 (in place); keys: [T, H, D] bf16; positions: [T, 3] int64 | None;
    # ring_slots: [T] int, -1 = skip
    """
    check_write_args(ring, keys, positions, ring_slots)
    if not ring.is_cuda:
        check_slot_values(ring_slots, ring.shape[0], ring.shape[1])
    if not use_triton(ring):
        ref.write_qsa_ring(ring, keys, positions, ring_slots)
        return
    from kpool_pd.kernels.qsa_ring.triton import write_qsa_ring_triton

    write_qsa_ring_triton(ring, keys, positions, ring_slots)


def read_qsa_ring_positions(
    ring: torch.Tensor, ring_id: int, slots: torch.Tensor, *, head_size: int | None = None
) -> torch.Tensor:
    """The packed positions of rows ``slots`` of ring ``ring_id`` (read from head 0; see ``ref``). Checks the
    ring, the ring id and the slots (a host synchronisation on CUDA slots); ``head_size`` (D), when given, is
    checked against the row width.

    # ring: [num_rings, C, H, W] bf16; slots: [n] int rows of ring ``ring_id`` (pos % C) -> [n, 3] int64
    """
    check_read_args(ring, ring_id, slots, head_size)
    return ref.read_qsa_ring_positions(ring, ring_id, slots)


__all__ = ["POSITION_SLOTS", "position_offset", "read_qsa_ring_positions", "write_qsa_ring"]
