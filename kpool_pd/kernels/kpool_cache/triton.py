"""Triton paged write and read of kpool indexer entries (slot = block * S + state; -1 skips a write).

``entry_offsets`` is the one place a kernel turns (block, state) into the addresses of an entry's
fp8 bytes and scale in the kernel pages; every kpool kernel that touches the indexer cache calls it,
with the strides of ``page_strides``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.kpool_compress.triton import DIM
from kpool_pd.kernels.triton_helpers import decode_e4m3

BLOCK_ENTRIES = 16


@triton.jit
def entry_offsets(block, state, PAGE: tl.constexpr, iq_block, iq_page, iq_entry, is_block, is_page, is_entry):
    """(q byte offset, scale element offset) of state ``state`` of block ``block``: entry ``state % PAGE`` of
    kernel page ``state // PAGE``. # block, state: int64 tensors of one shape -> two int64 tensors of that shape"""
    page = state // PAGE
    entry = state % PAGE
    return (block * iq_block + page * iq_page + entry * iq_entry,
            block * is_block + page * is_page + entry * is_entry)


def page_strides(indexer_q: torch.Tensor, indexer_scale: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """The strides ``entry_offsets`` takes: indexer_q's (block, page, entry) in bytes, indexer_scale's in fp32.

    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages, states_per_page]
    """
    assert indexer_q.stride(3) == 1, f"indexer_q rows must be contiguous, got strides {indexer_q.stride()}"
    return (indexer_q.stride(0), indexer_q.stride(1), indexer_q.stride(2),
            indexer_scale.stride(0), indexer_scale.stride(1), indexer_scale.stride(2))


@triton.jit
def _write_kernel(iq_ptr, is_ptr, q_ptr, scale_ptr, slots_ptr, count, states, iq_block, iq_page, iq_entry, is_block,
                  is_page, is_entry, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    # iq: [num_blocks, pages, PAGE, 128] uint8 view; is: [num_blocks, pages, PAGE] fp32
    # q: [P, 128] uint8; scale, slots: [P]
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, 128)
    slot = tl.load(slots_ptr + rows, mask=rows < count, other=-1).to(tl.int64)
    live = slot >= 0
    q_at, scale_at = entry_offsets(slot // states, slot % states, PAGE, iq_block, iq_page, iq_entry, is_block, is_page,
                                   is_entry)
    codes = tl.load(q_ptr + rows[:, None] * 128 + dims[None, :], mask=live[:, None])
    tl.store(iq_ptr + q_at[:, None] + dims[None, :], codes, mask=live[:, None])
    tl.store(is_ptr + scale_at, tl.load(scale_ptr + rows, mask=live), mask=live)


@triton.jit
def _read_kernel(iq_ptr, is_ptr, slots_ptr, q_ptr, scale_ptr, out_ptr, count, states, iq_block, iq_page, iq_entry,
                 is_block, is_page, is_entry, PAGE: tl.constexpr, BLOCK: tl.constexpr, DEQUANTIZE: tl.constexpr):
    # q: [P, 128] uint8 and scale: [P] fp32, or out: [P, 128] fp32 when DEQUANTIZE
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, 128)
    live = rows < count
    slot = tl.load(slots_ptr + rows, mask=live, other=0).to(tl.int64)
    q_at, scale_at = entry_offsets(slot // states, slot % states, PAGE, iq_block, iq_page, iq_entry, is_block, is_page,
                                   is_entry)
    codes = tl.load(iq_ptr + q_at[:, None] + dims[None, :], mask=live[:, None])
    scale = tl.load(is_ptr + scale_at, mask=live)
    if DEQUANTIZE:
        values = decode_e4m3(codes) * scale[:, None]
        tl.store(out_ptr + rows[:, None] * 128 + dims[None, :], values, mask=live[:, None])
    else:
        tl.store(q_ptr + rows[:, None] * 128 + dims[None, :], codes, mask=live[:, None])
        tl.store(scale_ptr + rows, scale, mask=live)


def write_entries_triton(indexer_q: torch.Tensor, indexer_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                         slots: torch.Tensor) -> None:
    """# indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages, states_per_page]
    # fp32; q: [P, 128] fp8; scale, slots: [P]"""
    count = q.shape[0]
    if count == 0:
        return
    q, scale, slots = q.contiguous(), scale.contiguous(), slots.contiguous()
    _write_kernel[(triton.cdiv(count, BLOCK_ENTRIES),)](
        indexer_q.view(torch.uint8), indexer_scale, q.view(torch.uint8), scale, slots, count,
        indexer_q.shape[1] * indexer_q.shape[2], *page_strides(indexer_q, indexer_scale), PAGE=indexer_q.shape[2],
        BLOCK=BLOCK_ENTRIES, num_warps=4,
    )


def read_entries_triton(indexer_q: torch.Tensor, indexer_scale: torch.Tensor, slots: torch.Tensor, *,
                        dequantize: bool):
    """# slots: [P] int >= 0 -> [P, 128] fp32 when dequantize, else (q: [P, 128] fp8, scale: [P] fp32)"""
    count, device = slots.shape[0], indexer_q.device
    q = torch.empty(count, DIM, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(count, dtype=torch.float32, device=device)
    out = torch.empty(count, DIM, dtype=torch.float32, device=device) if dequantize else scale
    if count:
        _read_kernel[(triton.cdiv(count, BLOCK_ENTRIES),)](
            indexer_q.view(torch.uint8), indexer_scale, slots.contiguous(), q.view(torch.uint8), scale, out, count,
            indexer_q.shape[1] * indexer_q.shape[2], *page_strides(indexer_q, indexer_scale), PAGE=indexer_q.shape[2],
            BLOCK=BLOCK_ENTRIES, DEQUANTIZE=dequantize, num_warps=4,
        )
    return out if dequantize else (q, scale)
