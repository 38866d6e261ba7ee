"""Triton QSA ring write: whole rows (raw key bits, zeros, packed int64 positions) scattered by slot.

Pure byte movement, so the ring's bytes equal the reference's exactly. The row is moved in the widest
unit that every size, offset and stride divides (8 bytes for the usual D = 128 with packed positions:
the key is 32 words, the positions 3), in three parts: the key, the zeros between the key and the
positions (or to the row's end without positions), the positions. One program per BLOCK_T tokens; a
program whose tokens all have slot -1 (a prefill's tokens before each request's last C) returns after
reading its slots. The forward update, whose metadata gives a slot to each request's last C tokens
alone, writes a long chunk's rows with one program per BLOCK_E of those tokens instead. Every head of a token gets the same positions. Slots outside ``[0, num_rings * C)``
(-1 among them) are skipped; on CUDA tensors nothing checks them on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.triton_helpers import gdc_launch_dependents, gdc_wait

POSITION_SLOTS = 12
_UNITS = ((4, torch.int64), (2, torch.int32), (1, torch.int16))  # bf16 elements a unit, its dtype


@triton.jit
def store_ring_head(ring_ptr, dst, value, packed, write, D: tl.constexpr, D_P2: tl.constexpr, ZEROS: tl.constexpr,
                    ZEROS_P2: tl.constexpr, OFF: tl.constexpr, P: tl.constexpr, P_P2: tl.constexpr,
                    ROPE: tl.constexpr):
    """Store one head's whole rows at element offsets ``dst`` where ``write``: the key bits, the zeros after them,
    the packed positions (``packed`` is read only with ROPE). Sizes in units.

    # dst: [N] int64; value: [N, D_P2]; packed: [N, P_P2]; write: [N] bool
    """
    cols = tl.arange(0, D_P2)
    tl.store(ring_ptr + dst[:, None] + cols[None, :], value, mask=write[:, None] & (cols < D)[None, :])
    if ZEROS > 0:
        z = tl.arange(0, ZEROS_P2)
        tl.store(ring_ptr + dst[:, None] + D + z[None, :], tl.zeros((dst.shape[0], ZEROS_P2), value.dtype),
                 mask=write[:, None] & (z < ZEROS)[None, :])
    if ROPE:
        p = tl.arange(0, P_P2)
        tl.store(ring_ptr + dst[:, None] + OFF + p[None, :], packed, mask=write[:, None] & (p < P)[None, :])


@triton.jit
def write_ring_rows(ring_ptr, keys_ptr, pos_ptr, tok, slot, write, heads, ring_stride, slot_stride, head_stride,
                    key_tok_stride, key_head_stride, CAP: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                    ZEROS: tl.constexpr, ZEROS_P2: tl.constexpr, OFF: tl.constexpr, P: tl.constexpr,
                    P_P2: tl.constexpr, ROPE: tl.constexpr):
    """Write token tok's whole ring row at slot (every head) where ``write``; sizes and strides in units.

    # tok, slot: [N] int64; write: [N] bool; ring: [num_rings, CAP, H, W]; keys: [T, H, D]; positions: [T, P]
    """
    row = (slot // CAP) * ring_stride + (slot % CAP) * slot_stride
    cols = tl.arange(0, D_P2)
    key_mask = write[:, None] & (cols < D)[None, :]
    p = tl.arange(0, P_P2)
    if ROPE:
        packed = tl.load(pos_ptr + tok[:, None] * P + p[None, :], mask=write[:, None] & (p < P)[None, :])
    else:
        packed = tl.zeros((tok.shape[0], P_P2), tl.int16)  # not stored without positions
    for h in range(heads):
        value = tl.load(keys_ptr + (tok * key_tok_stride + h * key_head_stride)[:, None] + cols[None, :], mask=key_mask)
        store_ring_head(ring_ptr, row + h * head_stride, value, packed, write, D, D_P2, ZEROS, ZEROS_P2, OFF, P, P_P2,
                        ROPE)


@triton.jit
def ring_write_kernel(ring_ptr, keys_ptr, pos_ptr, slots_ptr, tokens, heads, total_rows,
                      ring_stride, slot_stride, head_stride, key_tok_stride, key_head_stride,
                      CAP: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, ZEROS: tl.constexpr,
                      ZEROS_P2: tl.constexpr, OFF: tl.constexpr, P: tl.constexpr, P_P2: tl.constexpr,
                      ROPE: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr, EARLY_SLOTS: tl.constexpr):
    # in units of the chosen width: ring: [num_rings, CAP, H, W]; keys: [T, H, D]; positions: [T, P]; slots: [T] int64
    # EARLY_SLOTS (with PDL, behind the update's compression, which writes no slot): the slots are read before the
    # wait, so that read overlaps the compression (the compression itself starts its dependents only after its own
    # wait, so the slots are complete by then)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tok < tokens
    if EARLY_SLOTS:
        slot = tl.load(slots_ptr + tok, mask=live, other=-1).to(tl.int64)
    if PDL:  # launched before the previous kernel ends (the update's compression, which reads the ring): wait for it
        gdc_wait()
        gdc_launch_dependents()
    if not EARLY_SLOTS:
        slot = tl.load(slots_ptr + tok, mask=live, other=-1).to(tl.int64)
    write = live & (slot >= 0) & (slot < total_rows)
    if tl.max(write.to(tl.int32), axis=0) > 0:
        write_ring_rows(ring_ptr, keys_ptr, pos_ptr, tok, slot, write, heads, ring_stride, slot_stride, head_stride,
                        key_tok_stride, key_head_stride, CAP, D, D_P2, ZEROS, ZEROS_P2, OFF, P, P_P2, ROPE)


@triton.jit
def ring_write_last_kernel(ring_ptr, keys_ptr, pos_ptr, slots_ptr, qsl_ptr, requests, heads, total_rows,
                           ring_stride, slot_stride, head_stride, key_tok_stride, key_head_stride,
                           CAP: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, ZEROS: tl.constexpr,
                           ZEROS_P2: tl.constexpr, OFF: tl.constexpr, P: tl.constexpr, P_P2: tl.constexpr,
                           ROPE: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    # the ring write of ring_write_kernel, over each request's last CAP tokens only (entry e: request e // CAP,
    # its token q_end - CAP + e % CAP where that is one of its tokens); qsl: [requests + 1] int
    entry = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    req = entry // CAP
    live = req < requests
    if PDL:  # launched before the previous kernel ends (the update's compression, which reads the ring): wait for it
        gdc_wait()
        gdc_launch_dependents()
    q0 = tl.load(qsl_ptr + req, mask=live, other=0).to(tl.int64)
    q1 = tl.load(qsl_ptr + req + 1, mask=live, other=0).to(tl.int64)
    tok = q1 - CAP + entry % CAP
    live = live & (tok >= q0)
    slot = tl.load(slots_ptr + tok, mask=live, other=-1).to(tl.int64)  # tok is read only where live (masked)
    write = live & (slot >= 0) & (slot < total_rows)
    if tl.max(write.to(tl.int32), axis=0) > 0:
        write_ring_rows(ring_ptr, keys_ptr, pos_ptr, tok, slot, write, heads, ring_stride,
                        slot_stride, head_stride, key_tok_stride, key_head_stride, CAP, D, D_P2, ZEROS, ZEROS_P2,
                        OFF, P, P_P2, ROPE)


@dataclass(frozen=True, kw_only=True)
class RingUnits:
    """A ring write's views in the widest unit that every size, offset and stride divides. Strides and the
    sizes below are in units; ``ring``, ``keys`` and ``positions`` are the viewed tensors."""

    ring: torch.Tensor
    keys: torch.Tensor
    positions: torch.Tensor | None
    unit: int  # bf16 elements a unit
    head_size: int
    zeros: int
    offset: int
    position_units: int

    def strides(self) -> tuple[int, ...]:
        return (self.ring.stride(0), self.ring.stride(1), self.ring.stride(2), self.keys.stride(0), self.keys.stride(1))

    def constants(self) -> dict:
        return dict(D=self.head_size, D_P2=triton.next_power_of_2(self.head_size), ZEROS=self.zeros,
                    ZEROS_P2=triton.next_power_of_2(max(self.zeros, 1)), OFF=self.offset, P=self.position_units,
                    P_P2=triton.next_power_of_2(self.position_units), ROPE=self.positions is not None)


def ring_units(ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None) -> RingUnits:
    """# ring: [num_rings, C, H, W] bf16; keys: [T, H, D] bf16; positions: [T, 3] int64 | None"""
    width, head_size = ring.shape[3], keys.shape[2]
    off = width - POSITION_SLOTS if positions is not None else width
    sizes = (head_size, width, off, ring.stride(0), ring.stride(1), ring.stride(2), keys.stride(0), keys.stride(1),
             ring.storage_offset(), keys.storage_offset())
    unit, dtype = next((u, t) for u, t in _UNITS if all(n % u == 0 for n in sizes))
    return RingUnits(ring=ring.view(torch.int16).view(dtype), keys=keys.view(torch.int16).view(dtype),
                     positions=positions.contiguous().view(dtype) if positions is not None else None, unit=unit,
                     head_size=head_size // unit, zeros=(off - head_size) // unit, offset=off // unit,
                     position_units=POSITION_SLOTS // unit)


def write_qsa_ring_triton(ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None,
                          ring_slots: torch.Tensor, *, pdl: bool = False,
                          query_start_loc: torch.Tensor | None = None, after_update: bool = False) -> None:
    """``pdl``: launch with programmatic dependent launch (the kernel waits for the previous one before reading
    anything); only where ``kpool_pd.kernels.triton_helpers.pdl_available()``. ``query_start_loc``: given when only each
    request's last C tokens can have a slot (the forward update's metadata): with more tokens than requests x C,
    the grid then covers those tokens alone (one program per BLOCK_E of them) instead of every token.
    ``after_update`` (with ``pdl``): the launch directly follows the forward update's compression kernel (which
    writes no slot and starts this kernel only after its own wait), so the slots are read before the wait.

    # ring: [num_rings, C, H, W] bf16 (in place); keys: [T, H, D] bf16; positions: [T, 3] int64 | None;
    # slots: [T] int64; query_start_loc: [B + 1] int | None
    """
    num_rings, capacity, heads, _ = ring.shape
    tokens = keys.shape[0]
    if tokens == 0 or heads == 0:
        return
    assert ring.stride(3) == 1 and keys.stride(2) == 1, "ring and key rows must be contiguous"
    units = ring_units(ring, keys, positions)
    extra = {"launch_pdl": True} if pdl else {}
    pos_arg = units.positions if positions is not None else ring_slots
    requests = query_start_loc.shape[0] - 1 if query_start_loc is not None else 0
    if query_start_loc is not None and tokens > requests * capacity:
        block_e = 32 if keys.is_cuda else 8
        ring_write_last_kernel[(triton.cdiv(requests * capacity, block_e),)](
            units.ring, units.keys, pos_arg, ring_slots, query_start_loc, requests, heads, num_rings * capacity,
            *units.strides(), CAP=capacity, BLOCK_E=block_e, PDL=pdl, num_warps=4, **units.constants(), **extra,
        )
        return
    block_t = 32 if keys.is_cuda else 8
    ring_write_kernel[(triton.cdiv(tokens, block_t),)](
        units.ring, units.keys, pos_arg, ring_slots, tokens, heads, num_rings * capacity, *units.strides(),
        CAP=capacity, BLOCK_T=block_t, PDL=pdl, EARLY_SLOTS=pdl and after_update, num_warps=4, **units.constants(),
        **extra,
    )
