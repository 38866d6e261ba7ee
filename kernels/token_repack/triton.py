"""Triton token-range repack: one launch per field (MLA, then kpool entry and scale, or the QSA keys).

Each launch covers every layer and head of its field: grid ``(row tiles, layers, heads)``; a program
copies ``BLOCK_R`` consecutive global rows of one layer and head, ``BLOCK_E`` words of each piece at a
time. Row ``G`` maps to its block through the id tables (loaded on the device: no host sync), and to
its byte offset through ``geometry.FieldGeometry`` on each side (int64 offsets). The geometry is
compile-time (one kernel per layout pair and field, divisions by constants); the row count and the
pool sizes are runtime arguments, so a new length never recompiles. Pure byte movement in the widest
word (8, 4, 2 or 1 bytes) that divides every offset, piece and buffer address of the field: the result
is byte-identical to the reference. A row whose source or destination id lies outside its pool is
skipped (on CUDA tensors nothing checks the ids on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.token_repack.geometry import FieldGeometry, block_fields
from kvcache import BlockLayout

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
TILE_WORDS_CUDA = 2048  # words a program moves per piece chunk: 16 KiB at 8-byte words
TILE_WORDS_INTERPRETER = 8192  # the interpreter pays per program and per op: few tiles, not huge ones
MAX_CHUNK_WORDS = 32  # a piece moves in chunks of at most this many words (little masked waste: 82 -> 96)


@triton.jit(do_not_specialize=["num_rows", "src_count", "dst_count"])
def _token_repack_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, num_rows, src_count, dst_count,
    SRC_BLOCK: tl.constexpr, S_BASE: tl.constexpr, S_LAYER: tl.constexpr, S_RPB: tl.constexpr,
    S_RPP: tl.constexpr, S_PAGE: tl.constexpr, S_ROW: tl.constexpr, S_HEAD: tl.constexpr,
    DST_BLOCK: tl.constexpr, D_BASE: tl.constexpr, D_LAYER: tl.constexpr, D_RPB: tl.constexpr,
    D_RPP: tl.constexpr, D_PAGE: tl.constexpr, D_ROW: tl.constexpr, D_HEAD: tl.constexpr,
    PIECE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # src, dst: [blocks, *_BLOCK] words; src_ids, dst_ids: [>= num_rows / *_RPB] int; all geometry in words
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    layer = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    live = rows < num_rows
    s_id = tl.load(src_ids_ptr + rows // S_RPB, mask=live, other=-1).to(tl.int64)
    d_id = tl.load(dst_ids_ptr + rows // D_RPB, mask=live, other=-1).to(tl.int64)
    live = live & (s_id >= 0) & (s_id < src_count) & (d_id >= 0) & (d_id < dst_count)
    s_row = rows % S_RPB
    d_row = rows % D_RPB
    src = (s_id * SRC_BLOCK + S_BASE + layer * S_LAYER + head * S_HEAD
           + (s_row // S_RPP).to(tl.int64) * S_PAGE + (s_row % S_RPP).to(tl.int64) * S_ROW)
    dst = (d_id * DST_BLOCK + D_BASE + layer * D_LAYER + head * D_HEAD
           + (d_row // D_RPP).to(tl.int64) * D_PAGE + (d_row % D_RPP).to(tl.int64) * D_ROW)
    for e0 in tl.static_range(0, PIECE, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        m = live[:, None] & (e < PIECE)[None, :]
        piece = tl.load(src_ptr + src[:, None] + e[None, :], mask=m)
        tl.store(dst_ptr + dst[:, None] + e[None, :], piece, mask=m)


def word_bytes(values: list[int]) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing every value."""
    return next((size for size in (8, 4, 2) if all(v % size == 0 for v in values)), 1)


def _geometry_words(field: FieldGeometry, word: int) -> tuple[int, ...]:
    return (field.base // word, field.layer_stride // word, field.rows_per_block, field.rows_per_page,
            field.page_stride // word, field.row_stride // word, field.head_stride // word)


def tile(piece_words: int, *, interpreter: bool) -> tuple[int, int]:
    """(BLOCK_R rows, BLOCK_E words) of a program for pieces of ``piece_words`` words."""
    block_e = min(triton.next_power_of_2(piece_words), MAX_CHUNK_WORDS)
    budget = TILE_WORDS_INTERPRETER if interpreter else TILE_WORDS_CUDA
    return max(1, budget // block_e), block_e


def repack_tokens_triton(src_blocks: torch.Tensor, src_layout: BlockLayout, src_ids: torch.Tensor,
                         dst_blocks: torch.Tensor, dst_layout: BlockLayout, dst_ids: torch.Tensor,
                         num_tokens: int) -> None:
    # src_blocks: [Ns, src block_bytes] uint8; dst_blocks: [Nd, dst block_bytes] uint8 (in place);
    # src_ids: [>= ceil(n / src block_size)] int; dst_ids: [>= ceil(n / dst block_size)] int; n = num_tokens
    if num_tokens == 0:
        return
    interpreter = not src_blocks.is_cuda
    layers = len(src_layout.layers)
    for src_field, dst_field in zip(block_fields(src_layout), block_fields(dst_layout), strict=True):
        assert (src_field.kind, src_field.heads, src_field.piece_bytes, src_field.tokens_per_row) == \
            (dst_field.kind, dst_field.heads, dst_field.piece_bytes, dst_field.tokens_per_row), (src_field, dst_field)
        word = word_bytes([*src_field.strides(), *dst_field.strides(), src_blocks.stride(0), dst_blocks.stride(0),
                           src_blocks.data_ptr(), dst_blocks.data_ptr()])
        src, dst = src_blocks.view(_WORDS[word]), dst_blocks.view(_WORDS[word])
        piece_words = src_field.piece_bytes // word
        block_r, block_e = tile(piece_words, interpreter=interpreter)
        rows = src_field.rows_for_tokens(num_tokens)
        grid = (triton.cdiv(rows, block_r), layers, src_field.heads)
        _token_repack_kernel[grid](
            src, dst, src_ids, dst_ids, rows, src_blocks.shape[0], dst_blocks.shape[0],
            src.stride(0), *_geometry_words(src_field, word), dst.stride(0), *_geometry_words(dst_field, word),
            PIECE=piece_words, BLOCK_R=block_r, BLOCK_E=block_e, num_warps=4,
        )
