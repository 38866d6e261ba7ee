"""Where each row of a block's pages lives, as affine byte offsets: the one statement of the block
geometry that the token repack's kernel reads (the reference reads the pages through typed views).

A layer's pages hold **rows**, each ``tokens_per_row`` tokens wide, of one or more **fields**:

| field        | row                     | heads | piece            |
|--------------|-------------------------|-------|------------------|
| MLA          | one token               | H     | C (entry bytes)  |
| kpool entry  | one state (kpool tokens)| 1     | 128 fp8 bytes    |
| kpool scale  | one state               | 1     | 4 (its fp32)     |
| QSA keys     | one group (r tokens)    | H     | D * element size |

Head ``h`` of row ``g`` of layer ``l`` inside a block starts at byte::

    base + l * layer_stride + (g // rows_per_page) * page_stride + (g % rows_per_page) * row_stride
         + h * head_stride

and spans ``piece_bytes`` bytes. A request's global row ``G`` lives in block ``ids[G // rows_per_block]``
at row ``G % rows_per_block``; the rows of positions ``[0, n)`` are ``[0, ceil(n / tokens_per_row))``.
The kpool rows sit in kernel pages of ``rows_per_page`` states (``page_stride`` bytes apart); every
other field is one page a block (``rows_per_page == rows_per_block``). The BLNHC order puts a row's
heads side by side (``row_stride = H * piece``, ``head_stride = piece``), BLHNC puts a head's rows
side by side (``row_stride = piece``, ``head_stride = rows_per_block * piece``).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kvcache import FP8_ENTRY_BYTES, INDEX_HEAD_DIM, BlockLayout, BlockOrder, KpoolFamilySpec, QsaFamilySpec

KPOOL_SCALE_BYTES = FP8_ENTRY_BYTES - INDEX_HEAD_DIM  # one fp32


class FieldKind(enum.Enum):
    """The fields a block's pages hold; a layout has MLA and either both kpool fields or the QSA keys."""

    MLA = "mla"
    KPOOL_ENTRY = "kpool_entry"
    KPOOL_SCALE = "kpool_scale"
    QSA_KEYS = "qsa_keys"


@dataclass(frozen=True, kw_only=True)
class FieldGeometry:
    """One field of every layer of a block, in bytes (see the module docstring for the offset formula)."""

    kind: FieldKind
    tokens_per_row: int
    base: int
    layer_stride: int
    rows_per_block: int
    rows_per_page: int
    page_stride: int
    row_stride: int
    heads: int
    head_stride: int
    piece_bytes: int

    def __post_init__(self) -> None:
        if self.rows_per_block % self.rows_per_page:
            raise ValueError(f"{self.kind.value}: rows_per_page {self.rows_per_page} does not divide "
                             f"rows_per_block {self.rows_per_block}")

    def rows_for_tokens(self, num_tokens: int) -> int:
        """Rows that hold a token of positions ``[0, num_tokens)``: ceil(num_tokens / tokens_per_row)."""
        return -(-num_tokens // self.tokens_per_row)

    def offset(self, *, layer: int, row: int, head: int) -> int:
        """Byte offset inside a block of head ``head`` of row ``row`` (of the block) of layer ``layer``."""
        page, entry = divmod(row, self.rows_per_page)
        return (self.base + layer * self.layer_stride + page * self.page_stride + entry * self.row_stride
                + head * self.head_stride)

    @property
    def rows_contiguous(self) -> bool:
        """A page's rows (of one head) lie back to back: a run of them is one byte range."""
        return self.row_stride == self.piece_bytes

    def heads_folded(self) -> FieldGeometry:
        """The same bytes with a row's heads as one piece, where they lie side by side (BLNHC, or one head);
        otherwise the field itself."""
        if self.heads == 1 or self.head_stride != self.piece_bytes or self.row_stride != self.heads * self.piece_bytes:
            return self
        return dataclasses.replace(self, heads=1, head_stride=0, piece_bytes=self.heads * self.piece_bytes)

    def strides(self) -> tuple[int, ...]:
        """Every byte distance the offset formula adds (a word size that divides these, the buffers' row
        and their addresses divides every piece's start)."""
        return (self.base, self.layer_stride, self.page_stride, self.row_stride, self.head_stride, self.piece_bytes)


def _layer_stride(offsets: list[int]) -> int:
    stride = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    assert all(o == offsets[0] + i * stride for i, o in enumerate(offsets)), offsets  # BlockLayout's invariant
    return stride


def _ordered(kind: FieldKind, *, tokens_per_row: int, base: int, layer_stride: int, rows: int, heads: int,
             piece: int, order: BlockOrder) -> FieldGeometry:
    """A one-page field stored ``[rows, heads, piece]`` (BLNHC) or ``[heads, rows, piece]`` (BLHNC)."""
    if order is BlockOrder.BLNHC:
        row_stride, head_stride = heads * piece, piece
    else:
        row_stride, head_stride = piece, rows * piece
    return FieldGeometry(kind=kind, tokens_per_row=tokens_per_row, base=base, layer_stride=layer_stride,
                         rows_per_block=rows, rows_per_page=rows, page_stride=rows * heads * piece,
                         row_stride=row_stride, heads=heads, head_stride=head_stride, piece_bytes=piece)


def block_fields(layout: BlockLayout) -> tuple[FieldGeometry, ...]:
    """The fields of a layout's blocks: MLA, then kpool entry and scale, or the QSA keys. Two layouts of
    one cache (differing in block size, order or kernel page) give the same kinds, heads and pieces
    in the same order."""
    config = layout.config
    mla = config.mla
    mla_offsets = [p.mla_offset for p in layout.layers]
    indexer_offsets = [p.indexer_offset for p in layout.layers]
    layer_stride = _layer_stride(mla_offsets)
    assert _layer_stride(indexer_offsets) in (layer_stride, 0)
    fields = [_ordered(FieldKind.MLA, tokens_per_row=1, base=mla_offsets[0], layer_stride=layer_stride,
                       rows=mla.block_size, heads=mla.num_heads, piece=mla.entry_bytes, order=mla.order)]
    family = config.family_spec
    if isinstance(family, KpoolFamilySpec):
        per_page = family.states_per_page
        page_stride = family.indexer.kernel_page_bytes
        for kind, start, piece in ((FieldKind.KPOOL_ENTRY, 0, INDEX_HEAD_DIM),
                                   (FieldKind.KPOOL_SCALE, per_page * INDEX_HEAD_DIM, KPOOL_SCALE_BYTES)):
            fields.append(FieldGeometry(
                kind=kind, tokens_per_row=family.tokens_per_entry, base=indexer_offsets[0] + start,
                layer_stride=layer_stride, rows_per_block=family.entries_per_block, rows_per_page=per_page,
                page_stride=page_stride, row_stride=piece, heads=1, head_stride=0, piece_bytes=piece))
    else:
        assert isinstance(family, QsaFamilySpec)
        keys = family.keys
        fields.append(_ordered(FieldKind.QSA_KEYS, tokens_per_row=keys.compress_ratio, base=indexer_offsets[0],
                               layer_stride=layer_stride, rows=keys.rows_per_block, heads=keys.num_heads,
                               piece=keys.head_size * keys.element_bytes, order=keys.order))
    return tuple(fields)
