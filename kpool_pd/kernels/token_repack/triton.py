"""Triton token-range repack: one launch per field (MLA, then kpool entry and scale, or the QSA keys), or one
launch for all of them where every field is a one-head run field (a kpool cache's three: ``_fused_runs_kernel``,
grid ``(row tiles, layers, fields)``; on one H100 the three launches took 121 us of host time at 1,024 tokens).

Each field's launch covers every layer and head of its field: grid ``(row tiles, layers, heads)``. Global row ``G``
maps to its block through the id tables (loaded on the device: no host sync) and to its offset through
``kvcache.FieldGeometry`` on each side (int64 offsets). Two kernels:

- **runs**, where a row's pieces lie back to back on both sides (one head, BLNHC heads folded into one
  piece, or BLHNC on both sides): a tile of ``BLOCK_R`` rows that stays inside one page on both sides
  (``BLOCK_R`` divides both sides' rows per page) is one byte range on each side, copied flat in chunks
  of ``CHUNK`` words: full lanes and 16-byte accesses, the bulk of a request (its MLA rows) at copy speed;
- **rows**, otherwise (the orders differ and there are several heads): a tile of ``BLOCK_R`` rows of one
  head, ``BLOCK_E`` words of each piece at a time.

The geometry is compile-time (one kernel per layout pair and field, divisions by constants); the row count
and the pool sizes are runtime arguments, so a new length never recompiles. Each pair's launches (words,
tiles, geometry) are worked out once (``launch_plan``): a call pays only its launches on the host. Pure byte movement in the
widest word (8, 4, 2 or 1 bytes) that divides every offset, piece and buffer address of the field; with a
``VEC``-word alignment hint where they are all 16-byte multiples. The result is byte-identical to the
reference. A row whose source or destination id lies outside its pool is skipped (on CUDA tensors nothing
checks the ids on the host).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kpool_pd.kvcache import BlockLayout, CacheConfig, FieldGeometry

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
RUN_WORDS_CUDA = 4096  # most words of one run tile (32 KiB at 8-byte words; 4096-8192 measured alike on an H200)
RUN_CHUNK_CUDA = 1024  # words a run program moves per step: 8 a thread with 4 warps
NUM_WARPS = 4  # warps a program (4 and 8 measured alike on an H200 at 1k and 32k tokens)
ROW_TILE_WORDS_CUDA = 4096  # words a rows program moves per piece chunk
INTERPRETER_TILE_WORDS = 8192  # the interpreter pays per program and per op: few tiles, not huge ones
MAX_PIECE_CHUNK = 64  # a rows program moves a piece in chunks of at most this many words


@triton.jit
def _ids_and_bases(src_ids_ptr, dst_ids_ptr, rows, live, src_count, dst_count, layer, head,
                   SRC_BLOCK, S_BASE, S_LAYER, S_RPB, S_RPP, S_PAGE, S_ROW, S_HEAD,
                   DST_BLOCK, D_BASE, D_LAYER, D_RPB, D_RPP, D_PAGE, D_ROW, D_HEAD):
    """(word offset of each row's piece in src, in dst, rows that may move) for global rows ``rows``."""
    s_id = tl.load(src_ids_ptr + rows // S_RPB, mask=live, other=-1).to(tl.int64)
    d_id = tl.load(dst_ids_ptr + rows // D_RPB, mask=live, other=-1).to(tl.int64)
    live = live & (s_id >= 0) & (s_id < src_count) & (d_id >= 0) & (d_id < dst_count)
    s_row = rows % S_RPB
    d_row = rows % D_RPB
    src = (s_id * SRC_BLOCK + S_BASE + layer * S_LAYER + head * S_HEAD
           + (s_row // S_RPP).to(tl.int64) * S_PAGE + (s_row % S_RPP).to(tl.int64) * S_ROW)
    dst = (d_id * DST_BLOCK + D_BASE + layer * D_LAYER + head * D_HEAD
           + (d_row // D_RPP).to(tl.int64) * D_PAGE + (d_row % D_RPP).to(tl.int64) * D_ROW)
    return src, dst, live


@triton.jit
def _run_tile(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, num_rows, src_count, dst_count, tile, layer, head,
              SRC_BLOCK: tl.constexpr, S_BASE: tl.constexpr, S_LAYER: tl.constexpr, S_RPB: tl.constexpr,
              S_RPP: tl.constexpr, S_PAGE: tl.constexpr, S_ROW: tl.constexpr, S_HEAD: tl.constexpr,
              DST_BLOCK: tl.constexpr, D_BASE: tl.constexpr, D_LAYER: tl.constexpr, D_RPB: tl.constexpr,
              D_RPP: tl.constexpr, D_PAGE: tl.constexpr, D_ROW: tl.constexpr, D_HEAD: tl.constexpr,
              PIECE: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr):
    # src, dst: [blocks, *_BLOCK] words; rows [row0, row0 + BLOCK_R) of one page on both sides, PIECE words a row;
    # a tile past num_rows moves nothing
    row0 = tile * BLOCK_R
    src, dst, live = _ids_and_bases(src_ids_ptr, dst_ids_ptr, row0, row0 < num_rows, src_count, dst_count, layer, head,
                                    SRC_BLOCK, S_BASE, S_LAYER, S_RPB, S_RPP, S_PAGE, S_ROW, S_HEAD,
                                    DST_BLOCK, D_BASE, D_LAYER, D_RPB, D_RPP, D_PAGE, D_ROW, D_HEAD)
    src = tl.multiple_of(src, VEC)
    dst = tl.multiple_of(dst, VEC)
    words = tl.multiple_of(tl.where(live, tl.minimum(num_rows - row0, BLOCK_R) * PIECE, 0), VEC)
    for e0 in tl.static_range(0, BLOCK_R * PIECE, CHUNK):
        e = e0 + tl.arange(0, CHUNK)
        m = e < words
        tl.store(dst_ptr + dst + e, tl.load(src_ptr + src + e, mask=m), mask=m)


@triton.jit(do_not_specialize=["num_rows", "src_count", "dst_count"])
def _runs_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, num_rows, src_count, dst_count,
    SRC_BLOCK: tl.constexpr, S_BASE: tl.constexpr, S_LAYER: tl.constexpr, S_RPB: tl.constexpr,
    S_RPP: tl.constexpr, S_PAGE: tl.constexpr, S_ROW: tl.constexpr, S_HEAD: tl.constexpr,
    DST_BLOCK: tl.constexpr, D_BASE: tl.constexpr, D_LAYER: tl.constexpr, D_RPB: tl.constexpr,
    D_RPP: tl.constexpr, D_PAGE: tl.constexpr, D_ROW: tl.constexpr, D_HEAD: tl.constexpr,
    PIECE: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr,
):
    # src, dst: [blocks, *_BLOCK] words; grid (row tiles, layers, heads): one tile of one page on both sides
    _run_tile(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, num_rows, src_count, dst_count, tl.program_id(0),
              tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64),
              SRC_BLOCK, S_BASE, S_LAYER, S_RPB, S_RPP, S_PAGE, S_ROW, S_HEAD,
              DST_BLOCK, D_BASE, D_LAYER, D_RPB, D_RPP, D_PAGE, D_ROW, D_HEAD, PIECE, BLOCK_R, CHUNK, VEC)


@triton.jit(do_not_specialize=["rows_a", "rows_b", "rows_c", "src_count", "dst_count"])
def _fused_runs_kernel(
    src_a, dst_a, src_b, dst_b, src_c, dst_c, src_ids_ptr, dst_ids_ptr, rows_a, rows_b, rows_c, src_count, dst_count,
    A_SRC_BLOCK: tl.constexpr, A_S_BASE: tl.constexpr, A_S_LAYER: tl.constexpr, A_S_RPB: tl.constexpr,
    A_S_RPP: tl.constexpr, A_S_PAGE: tl.constexpr, A_S_ROW: tl.constexpr, A_S_HEAD: tl.constexpr,
    A_DST_BLOCK: tl.constexpr, A_D_BASE: tl.constexpr, A_D_LAYER: tl.constexpr, A_D_RPB: tl.constexpr,
    A_D_RPP: tl.constexpr, A_D_PAGE: tl.constexpr, A_D_ROW: tl.constexpr, A_D_HEAD: tl.constexpr,
    A_PIECE: tl.constexpr, A_BLOCK_R: tl.constexpr, A_CHUNK: tl.constexpr, A_VEC: tl.constexpr,
    B_SRC_BLOCK: tl.constexpr, B_S_BASE: tl.constexpr, B_S_LAYER: tl.constexpr, B_S_RPB: tl.constexpr,
    B_S_RPP: tl.constexpr, B_S_PAGE: tl.constexpr, B_S_ROW: tl.constexpr, B_S_HEAD: tl.constexpr,
    B_DST_BLOCK: tl.constexpr, B_D_BASE: tl.constexpr, B_D_LAYER: tl.constexpr, B_D_RPB: tl.constexpr,
    B_D_RPP: tl.constexpr, B_D_PAGE: tl.constexpr, B_D_ROW: tl.constexpr, B_D_HEAD: tl.constexpr,
    B_PIECE: tl.constexpr, B_BLOCK_R: tl.constexpr, B_CHUNK: tl.constexpr, B_VEC: tl.constexpr,
    C_SRC_BLOCK: tl.constexpr, C_S_BASE: tl.constexpr, C_S_LAYER: tl.constexpr, C_S_RPB: tl.constexpr,
    C_S_RPP: tl.constexpr, C_S_PAGE: tl.constexpr, C_S_ROW: tl.constexpr, C_S_HEAD: tl.constexpr,
    C_DST_BLOCK: tl.constexpr, C_D_BASE: tl.constexpr, C_D_LAYER: tl.constexpr, C_D_RPB: tl.constexpr,
    C_D_RPP: tl.constexpr, C_D_PAGE: tl.constexpr, C_D_ROW: tl.constexpr, C_D_HEAD: tl.constexpr,
    C_PIECE: tl.constexpr, C_BLOCK_R: tl.constexpr, C_CHUNK: tl.constexpr, C_VEC: tl.constexpr,
):
    # Up to three one-head run fields (a, b, c; each its own word view of the same buffers) in one launch:
    # grid (most row tiles of a field, layers, fields); a program moves one tile of the field program_id(2) names
    tile = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    field = tl.program_id(2)
    if field == 0:
        _run_tile(src_a, dst_a, src_ids_ptr, dst_ids_ptr, rows_a, src_count, dst_count, tile, layer, 0,
                  A_SRC_BLOCK, A_S_BASE, A_S_LAYER, A_S_RPB, A_S_RPP, A_S_PAGE, A_S_ROW, A_S_HEAD,
                  A_DST_BLOCK, A_D_BASE, A_D_LAYER, A_D_RPB, A_D_RPP, A_D_PAGE, A_D_ROW, A_D_HEAD,
                  A_PIECE, A_BLOCK_R, A_CHUNK, A_VEC)
    elif field == 1:
        _run_tile(src_b, dst_b, src_ids_ptr, dst_ids_ptr, rows_b, src_count, dst_count, tile, layer, 0,
                  B_SRC_BLOCK, B_S_BASE, B_S_LAYER, B_S_RPB, B_S_RPP, B_S_PAGE, B_S_ROW, B_S_HEAD,
                  B_DST_BLOCK, B_D_BASE, B_D_LAYER, B_D_RPB, B_D_RPP, B_D_PAGE, B_D_ROW, B_D_HEAD,
                  B_PIECE, B_BLOCK_R, B_CHUNK, B_VEC)
    else:
        _run_tile(src_c, dst_c, src_ids_ptr, dst_ids_ptr, rows_c, src_count, dst_count, tile, layer, 0,
                  C_SRC_BLOCK, C_S_BASE, C_S_LAYER, C_S_RPB, C_S_RPP, C_S_PAGE, C_S_ROW, C_S_HEAD,
                  C_DST_BLOCK, C_D_BASE, C_D_LAYER, C_D_RPB, C_D_RPP, C_D_PAGE, C_D_ROW, C_D_HEAD,
                  C_PIECE, C_BLOCK_R, C_CHUNK, C_VEC)


@triton.jit(do_not_specialize=["num_rows", "src_count", "dst_count"])
def _rows_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, num_rows, src_count, dst_count,
    SRC_BLOCK: tl.constexpr, S_BASE: tl.constexpr, S_LAYER: tl.constexpr, S_RPB: tl.constexpr,
    S_RPP: tl.constexpr, S_PAGE: tl.constexpr, S_ROW: tl.constexpr, S_HEAD: tl.constexpr,
    DST_BLOCK: tl.constexpr, D_BASE: tl.constexpr, D_LAYER: tl.constexpr, D_RPB: tl.constexpr,
    D_RPP: tl.constexpr, D_PAGE: tl.constexpr, D_ROW: tl.constexpr, D_HEAD: tl.constexpr,
    PIECE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, VEC: tl.constexpr,
):
    # src, dst: [blocks, *_BLOCK] words; BLOCK_R rows of one head, PIECE words each, BLOCK_E at a time
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    src, dst, live = _ids_and_bases(src_ids_ptr, dst_ids_ptr, rows, rows < num_rows, src_count, dst_count,
                                    tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64),
                                    SRC_BLOCK, S_BASE, S_LAYER, S_RPB, S_RPP, S_PAGE, S_ROW, S_HEAD,
                                    DST_BLOCK, D_BASE, D_LAYER, D_RPB, D_RPP, D_PAGE, D_ROW, D_HEAD)
    src = tl.multiple_of(src, VEC)
    dst = tl.multiple_of(dst, VEC)
    for e0 in tl.static_range(0, PIECE, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        m = live[:, None] & (e < PIECE)[None, :]
        tl.store(dst_ptr + dst[:, None] + e[None, :], tl.load(src_ptr + src[:, None] + e[None, :], mask=m), mask=m)


def word_bytes(values: list[int], widest: int = 8) -> int:
    """The widest power-of-two size up to ``widest`` bytes dividing every value."""
    return next((size for size in (16, 8, 4, 2) if size <= widest and all(v % size == 0 for v in values)), 1)


def _geometry_words(field: FieldGeometry, block_words: int, word: int) -> tuple[int, ...]:
    return (block_words, field.base // word, field.layer_stride // word, field.rows_per_block, field.rows_per_page,
            field.page_stride // word, field.row_stride // word, field.head_stride // word)


def _run_rows(src: FieldGeometry, dst: FieldGeometry, piece_words: int, budget: int) -> int:
    """Rows of a run tile: the largest divisor of both sides' rows per page within ``budget`` words."""
    common = math.gcd(src.rows_per_page, dst.rows_per_page)
    return max(d for d in range(1, common + 1) if common % d == 0 and (d == 1 or d * piece_words <= budget))


@dataclass(frozen=True)
class FieldLaunch:
    """One field's launch, fixed by the layout pair and the buffers' row strides and alignments: the
    kernel, its geometry in words (source then destination), and its tile constants."""

    kernel: triton.JITFunction
    word: int  # bytes of the word the field moves in
    tokens_per_row: int
    layers: int
    heads: int
    geometry: tuple[int, ...]
    meta: tuple[tuple[str, int], ...]  # the kernel's remaining constexprs (PIECE, BLOCK_R, CHUNK or BLOCK_E, VEC)
    num_warps: int
    # the launch's keyword arguments (``meta`` and ``num_warps``) and tile rows, made once, not at every call
    options: dict[str, int] = field(init=False, compare=False, hash=False, repr=False)
    block_r: int = field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", {**dict(self.meta), "num_warps": self.num_warps})
        object.__setattr__(self, "block_r", self.options["BLOCK_R"])

    def grid(self, rows: int) -> tuple[int, int, int]:
        return (-(-rows // self.block_r), self.layers, self.heads)

    def rows(self, num_tokens: int) -> int:
        """The field's rows that hold positions [0, num_tokens)."""
        return -(-num_tokens // self.tokens_per_row)

    def launch(self, views: Callable[[int], tuple[torch.Tensor, torch.Tensor]], src_ids: torch.Tensor,
               dst_ids: torch.Tensor, num_tokens: int, src_count: int, dst_count: int) -> None:
        """Enqueue the field's copy; ``views(word)`` gives both buffers viewed as words of that many bytes."""
        rows = self.rows(num_tokens)
        self.kernel[self.grid(rows)](*views(self.word), src_ids, dst_ids, rows, src_count, dst_count, *self.geometry,
                                     **self.options)


@dataclass(frozen=True)
class FusedRunsLaunch:
    """Two or three one-head run fields (``_runs_kernel`` launches) moved by one launch of ``_fused_runs_kernel``:
    one host launch instead of one a field, and the small fields' tiles run beside the large one's."""

    parts: tuple[FieldLaunch, ...]
    # the kernel's three field slots (a missing third part repeats the second, whose programs never run) and its
    # constexprs in order (each slot's geometry then PIECE, BLOCK_R, CHUNK, VEC), made once
    slots: tuple[FieldLaunch, ...] = field(init=False, compare=False, hash=False, repr=False)
    constants: tuple[int, ...] = field(init=False, compare=False, hash=False, repr=False)

    @staticmethod
    def fits(launches: tuple[FieldLaunch, ...]) -> bool:
        """Whether one launch can move ``launches``: two or three of them, each a one-head run field."""
        return 2 <= len(launches) <= 3 and all(launch.kernel is _runs_kernel and launch.heads == 1
                                                for launch in launches)

    def __post_init__(self) -> None:
        assert self.fits(self.parts), self.parts
        slots = (*self.parts, self.parts[-1])[:3]
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "constants", tuple(value for part in slots
                                                    for value in (*part.geometry, *(v for _, v in part.meta))))

    def launch(self, views: Callable[[int], tuple[torch.Tensor, torch.Tensor]], src_ids: torch.Tensor,
               dst_ids: torch.Tensor, num_tokens: int, src_count: int, dst_count: int) -> None:
        rows = [part.rows(num_tokens) for part in self.slots]
        tiles = max(-(-r // part.block_r) for r, part in zip(rows, self.parts))
        buffers = [buffer for part in self.slots for buffer in views(part.word)]
        _fused_runs_kernel[(tiles, self.parts[0].layers, len(self.parts))](
            *buffers, src_ids, dst_ids, *rows, src_count, dst_count, *self.constants, num_warps=NUM_WARPS)


def fuse_runs(launches: tuple[FieldLaunch, ...]) -> tuple[FieldLaunch | FusedRunsLaunch, ...]:
    """One ``FusedRunsLaunch`` where every field is a one-head run field and there are two or three of them (a
    kpool cache's MLA rows, kpool entries and scales), else the launches as they are."""
    if FusedRunsLaunch.fits(launches):
        return (FusedRunsLaunch(launches),)
    return launches


def _field_launch(src_field: FieldGeometry, dst_field: FieldGeometry, src_stride: int, dst_stride: int,
                  src_address: int, dst_address: int, layers: int, interpreter: bool) -> FieldLaunch:
    assert (src_field.kind, src_field.heads, src_field.piece_bytes, src_field.tokens_per_row) == \
        (dst_field.kind, dst_field.heads, dst_field.piece_bytes, dst_field.tokens_per_row), (src_field, dst_field)
    folded = (src_field.heads_folded(), dst_field.heads_folded())
    if folded[0].heads == folded[1].heads:  # fold only where both sides can
        src_field, dst_field = folded
    addresses = [*src_field.strides(), *dst_field.strides(), src_stride, dst_stride, src_address, dst_address]
    word = word_bytes(addresses)
    vec = word_bytes(addresses, widest=16) // word  # words of a 16-byte-aligned access where all allow it
    piece = src_field.piece_bytes // word
    geometry = (*_geometry_words(src_field, src_stride // word, word), *_geometry_words(dst_field, dst_stride // word, word))
    if src_field.rows_contiguous and dst_field.rows_contiguous:
        block_r = _run_rows(src_field, dst_field, piece, INTERPRETER_TILE_WORDS if interpreter else RUN_WORDS_CUDA)
        chunk = min(INTERPRETER_TILE_WORDS if interpreter else RUN_CHUNK_CUDA, triton.next_power_of_2(block_r * piece))
        kernel, meta = _runs_kernel, (("PIECE", piece), ("BLOCK_R", block_r), ("CHUNK", chunk), ("VEC", vec))
    else:
        block_e = min(triton.next_power_of_2(piece), MAX_PIECE_CHUNK)
        block_r = max(1, (INTERPRETER_TILE_WORDS if interpreter else ROW_TILE_WORDS_CUDA) // block_e)
        kernel, meta = _rows_kernel, (("PIECE", piece), ("BLOCK_R", block_r), ("BLOCK_E", block_e), ("VEC", vec))
    return FieldLaunch(kernel=kernel, word=word, tokens_per_row=src_field.tokens_per_row, layers=layers, heads=src_field.heads,
                       geometry=geometry, meta=meta, num_warps=NUM_WARPS)


@functools.lru_cache(maxsize=256)
def launch_plan(src_config: CacheConfig, dst_config: CacheConfig, src_stride: int, dst_stride: int, src_align: int,
                dst_align: int, interpreter: bool) -> tuple[FieldLaunch | FusedRunsLaunch, ...]:
    """Every field's launch for a layout pair (the geometry is worked out once per pair, buffer row
    strides in bytes, and buffer address alignments (address mod 16), not at every call), run fields fused into
    one launch where ``fuse_runs`` can."""
    src_layout, dst_layout = BlockLayout(src_config), BlockLayout(dst_config)
    return fuse_runs(tuple(_field_launch(s, d, src_stride, dst_stride, src_align, dst_align, len(src_layout.layers),
                                         interpreter)
                           for s, d in zip(src_layout.fields, dst_layout.fields, strict=True)))


@functools.lru_cache(maxsize=256)
def _layouts_plan(src_layout: BlockLayout, dst_layout: BlockLayout, src_stride: int, dst_stride: int, src_align: int,
                  dst_align: int, interpreter: bool) -> tuple[FieldLaunch | FusedRunsLaunch, ...]:
    """``launch_plan`` looked up by the layout objects (kept alive here), which hash faster than their configs."""
    return launch_plan(src_layout.config, dst_layout.config, src_stride, dst_stride, src_align, dst_align, interpreter)


def repack_tokens_triton(src_blocks: torch.Tensor, src_layout: BlockLayout, src_ids: torch.Tensor,
                         dst_blocks: torch.Tensor, dst_layout: BlockLayout, dst_ids: torch.Tensor,
                         num_tokens: int, *, per_field: bool = False) -> None:
    """The repack's launches (``per_field``: one a field, never fused; for the bench's side-by-side)."""
    # src_blocks: [Ns, src block_bytes] uint8; dst_blocks: [Nd, dst block_bytes] uint8 (in place);
    # src_ids: [>= ceil(n / src block_size)] int; dst_ids: [>= ceil(n / dst block_size)] int; n = num_tokens
    if num_tokens == 0:
        return
    plan = _layouts_plan(src_layout, dst_layout, src_blocks.stride(0), dst_blocks.stride(0),
                         src_blocks.data_ptr() % 16, dst_blocks.data_ptr() % 16, not src_blocks.is_cuda)
    if per_field:
        plan = tuple(part for launch in plan for part in getattr(launch, "parts", (launch,)))
    viewed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the buffers as words of each size, viewed once

    def views(word: int) -> tuple[torch.Tensor, torch.Tensor]:
        if word not in viewed:
            dtype = _WORDS[word]
            viewed[word] = (src_blocks.view(dtype), dst_blocks.view(dtype))
        return viewed[word]

    for launch in plan:
        launch.launch(views, src_ids, dst_ids, num_tokens, src_blocks.shape[0], dst_blocks.shape[0])
