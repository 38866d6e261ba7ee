"""Triton MLA row write: grid (tokens, heads), one program copies one token's C bytes into one head's row.

The block and offset are loaded on the device (no host synchronisation: the launch can be captured in a
CUDA graph); a token whose block is negative writes nothing, which is how a padded batch's extra tokens
stay out of the cache. Pure byte movement: byte-identical to ``ref.write_rows``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_rows_kernel(mla_ptr, blocks_ptr, offsets_ptr, entries_ptr, s_block, s_row, s_head, C,
                       BLOCK_C: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(blocks_ptr + token).to(tl.int64)
    offset = tl.load(offsets_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    live = cols < tl.where(block >= 0, C, 0)  # a token without a block moves no byte
    row = tl.load(entries_ptr + token.to(tl.int64) * C + cols, mask=live)
    tl.store(mla_ptr + block * s_block + offset * s_row + head * s_head + cols, row, mask=live)


def write_rows_triton(mla: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, entries: torch.Tensor) -> None:
    """# mla: [num_blocks, N, H, C] uint8 (C contiguous); blocks, offsets: [T] int; entries: [T, C] uint8"""
    tokens, width = entries.shape
    if tokens == 0:
        return
    entries = entries.contiguous()
    _write_rows_kernel[(tokens, mla.shape[2])](mla, blocks, offsets, entries, mla.stride(0), mla.stride(1),
                                               mla.stride(2), width, BLOCK_C=triton.next_power_of_2(width))
