"""Triton QSA ring write: whole rows (raw key bits, zeros, packed int64 positions) scattered by slot.

Pure byte movement through int16 views, so the ring's bytes equal the reference's exactly. One
program per BLOCK_T tokens; every head of a token gets the same positions. Slots outside
``[0, num_rings * C)`` (-1 among them) are skipped; on CUDA tensors nothing checks them on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

POSITION_SLOTS = 12


@triton.jit
def ring_write_kernel(ring_ptr, keys_ptr, pos_ptr, slots_ptr, tokens, heads, total_rows, cap,
                      ring_stride, slot_stride, head_stride, key_tok_stride, key_head_stride,
                      D: tl.constexpr, W: tl.constexpr, W_P2: tl.constexpr, OFF: tl.constexpr,
                      ROPE: tl.constexpr, BLOCK_T: tl.constexpr):
    # ring: [num_rings, C, H, W] int16; keys: [T, H, D] int16; positions: [T, 12] int16 (3 int64); slots: [T] int64
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tok < tokens
    slot = tl.load(slots_ptr + tok, mask=live, other=-1).to(tl.int64)
    write = live & (slot >= 0) & (slot < total_rows)
    row = (slot // cap) * ring_stride + (slot % cap) * slot_stride
    cols = tl.arange(0, W_P2)
    is_key = cols < D
    if ROPE:
        is_pos = (cols >= OFF) & (cols < OFF + 12)
        packed = tl.load(pos_ptr + tok[:, None] * 12 + (cols - OFF)[None, :], mask=write[:, None] & is_pos[None, :],
                         other=0)
    for h in range(heads):
        value = tl.load(keys_ptr + (tok * key_tok_stride + h * key_head_stride)[:, None] + cols[None, :],
                        mask=write[:, None] & is_key[None, :], other=0)
        if ROPE:
            value = tl.where(is_pos[None, :], packed, value)
        tl.store(ring_ptr + (row + h * head_stride)[:, None] + cols[None, :], value,
                 mask=write[:, None] & (cols < W)[None, :])


def write_qsa_ring_triton(ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None,
                          ring_slots: torch.Tensor) -> None:
    # ring: [num_rings, C, H, W] bf16 (in place); keys: [T, H, D] bf16; positions: [T, 3] int64 | None; slots: [T] int64
    num_rings, capacity, heads, width = ring.shape
    tokens, _, head_size = keys.shape
    if tokens == 0 or heads == 0:
        return
    assert ring.stride(3) == 1 and keys.stride(2) == 1, "ring and key rows must be contiguous"
    off = width - POSITION_SLOTS if positions is not None else width
    packed = positions.contiguous().view(torch.int16) if positions is not None else ring_slots
    block_t = 32 if keys.is_cuda else 8
    ring_write_kernel[(triton.cdiv(tokens, block_t),)](
        ring.view(torch.int16), keys.view(torch.int16), packed, ring_slots, tokens, heads, num_rings * capacity, capacity,
        ring.stride(0), ring.stride(1), ring.stride(2), keys.stride(0), keys.stride(1),
        D=head_size, W=width, W_P2=triton.next_power_of_2(width), OFF=off, ROPE=positions is not None,
        BLOCK_T=block_t, num_warps=4,
    )
