"""Triton block repack: every page of every block pair, transposed or copied, in one launch per page kind.

Pure byte movement, in the widest word (8, 4, 2 or 1 bytes) that divides every offset and row, so
the result is byte-identical to the reference. Grid: (block pair, layer, tile of BLOCK_R destination
rows); each program copies its rows ``row_words`` at a time. A pair whose source or destination
id lies outside its pool is skipped (on CUDA tensors nothing checks the ids on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.block_repack.ref import repack_segments
from kvcache import BlockLayout

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _repack_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, src_blocks, dst_blocks, block_words, offset,
                   layer_stride, a, b, row_words, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    # src, dst: [blocks, block_words] words; a page: source [a, b, row_words] -> destination [b, a, row_words]
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    s = tl.load(src_ids_ptr + pair).to(tl.int64)
    d = tl.load(dst_ids_ptr + pair).to(tl.int64)
    if (s >= 0) & (s < src_blocks) & (d >= 0) & (d < dst_blocks):
        rows = tl.program_id(2).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < a * b
        src_row = (rows % a) * b + rows // a  # destination row (j, i) reads source row (i, j)
        page = offset + layer * layer_stride
        src = src_ptr + s * block_words + page + src_row * row_words
        dst = dst_ptr + d * block_words + page + rows * row_words
        for e0 in range(0, row_words, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            m = live[:, None] & (e < row_words)[None, :]
            tl.store(dst[:, None] + e[None, :], tl.load(src[:, None] + e[None, :], mask=m), mask=m)


def _word_bytes(values: list[int]) -> int:
    for size in (8, 4, 2):
        if all(v % size == 0 for v in values):
            return size
    return 1


def repack_blocks_triton(src_blocks: torch.Tensor, src_layout: BlockLayout, src_ids: torch.Tensor,
                         dst_blocks: torch.Tensor, dst_layout: BlockLayout, dst_ids: torch.Tensor) -> None:
    # src_blocks: [Ns, block_bytes] uint8; dst_blocks: [Nd, block_bytes] uint8 (in place); src_ids, dst_ids: [n] int
    pairs = src_ids.shape[0]
    if pairs == 0:
        return
    segments = repack_segments(src_layout, dst_layout)
    block_bytes = src_blocks.shape[1]
    word = _word_bytes([block_bytes, src_blocks.storage_offset(), dst_blocks.storage_offset(),
                        src_blocks.stride(0), dst_blocks.stride(0)]
                       + [v for seg in segments for v in (seg.offset, seg.layer_stride, seg.row_bytes)])
    src = src_blocks.view(_WORDS[word])
    dst = dst_blocks.view(_WORDS[word])
    for seg in segments:
        rows, row_words = seg.a * seg.b, seg.row_bytes // word
        if rows == 1:  # a plain copy: split the page into rows of up to 64 words
            row_words = next(w for w in (64, 32, 16, 8, 4, 2, 1) if (seg.row_bytes // word) % w == 0)
            a, b = 1, seg.row_bytes // word // row_words
        else:
            a, b = seg.a, seg.b
        block_e = min(triton.next_power_of_2(row_words), 128)
        block_r = max(1, min(triton.next_power_of_2(a * b), 4096 // block_e))
        if not src_blocks.is_cuda:
            block_r = min(block_r, 64)
        _repack_kernel[(pairs, seg.layers, triton.cdiv(a * b, block_r))](
            src, dst, src_ids, dst_ids, src_blocks.shape[0], dst_blocks.shape[0], src.stride(0), seg.offset // word,
            seg.layer_stride // word, a, b, row_words, BLOCK_R=block_r, BLOCK_E=block_e, num_warps=4,
        )
