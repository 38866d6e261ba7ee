"""The unified block layout (DESIGN section 4) and its hash.

A block holds ``block_size`` tokens of every layer, one contiguous byte range::

    block b: | layer 0: MLA page | layer 0: indexer pages | layer 1: MLA page | ... | pad |

A layer's kpool indexer pages are S / P kernel pages of P states each (one page of S states when
S <= P), back to back, each ``[P x 128 fp8 entries][P x 4 fp32 scales]`` (``KpoolIndexerSpec``).

A ring block holds every layer's ring of one request, **slot-major**::

    ring block: | slot 0: layer 0 row, layer 1 row, ... | slot 1: ... | ... | slot R-1 |

so the live range of a ring (consecutive positions, slots mod R) is one contiguous byte range,
or two when it wraps, whatever the number of layers. A layer's row in a slot is its K and gate
vectors (kpool: bf16[2, D]) or its key row (QSA: bf16[H, W]). Every block page starts on a
16-byte boundary so that typed views (fp8, bf16, fp32, int64) alias the bytes directly.

Where each row of a block's pages lives (``BlockLayout.fields``: one ``FieldGeometry`` a field, the one
statement of the page geometry that the pool's views, the token repack and the DCP plan read). A layer's
pages hold **rows**, each ``tokens_per_row`` tokens wide, of one or more **fields**:

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
import functools
import hashlib
import json
from dataclasses import dataclass

import torch

from kpool_pd.kvcache.config import CacheConfig
from kpool_pd.kvcache.family import KpoolFamilySpec
from kpool_pd.kvcache.specs import FP8_ENTRY_BYTES, INDEX_HEAD_DIM, BlockOrder

PAGE_ALIGN = 16
KPOOL_SCALE_BYTES = FP8_ENTRY_BYTES - INDEX_HEAD_DIM  # one fp32


def _align(n: int) -> int:
    return (n + PAGE_ALIGN - 1) // PAGE_ALIGN * PAGE_ALIGN


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

    def view(self, blocks: torch.Tensor, layer: int) -> torch.Tensor:
        """The field of layer ``layer`` in every block, aliasing ``blocks`` (no copy), in logical order
        whatever the storage order.
        # blocks: [N, block_bytes] uint8 -> [N, pages, rows_per_page, heads, piece_bytes] uint8"""
        pages = self.rows_per_block // self.rows_per_page
        return blocks.as_strided((blocks.shape[0], pages, self.rows_per_page, self.heads, self.piece_bytes),
                                 (blocks.stride(0), self.page_stride, self.row_stride, self.head_stride, 1),
                                 blocks.storage_offset() + self.base + layer * self.layer_stride)

    def strides(self) -> tuple[int, ...]:
        """Every byte distance the offset formula adds (a word size that divides these, the buffers' row
        and their addresses divides every piece's start)."""
        return (self.base, self.layer_stride, self.page_stride, self.row_stride, self.head_stride, self.piece_bytes)


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


@dataclass(frozen=True)
class LayerPages:
    """Byte offsets of one layer's pages inside a block, and of its row inside a ring slot."""

    index: int
    name: str
    mla_offset: int
    indexer_offset: int
    ring_row_offset: int


class BlockLayout:
    """Offsets and sizes of the block and ring-block formats of one ``CacheConfig``."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.mla_page_bytes = config.mla.page_bytes
        family = config.family_spec
        self.indexer_page_bytes = family.page_bytes
        self.ring_slots = family.ring_slots
        self.ring_row_bytes = family.ring_row_bytes
        pages = []
        block_cursor = 0
        for index, name in enumerate(config.layer_names):
            mla_offset = block_cursor
            indexer_offset = _align(mla_offset + self.mla_page_bytes)
            block_cursor = _align(indexer_offset + self.indexer_page_bytes)
            pages.append(LayerPages(index, name, mla_offset, indexer_offset, index * self.ring_row_bytes))
        self.layers: tuple[LayerPages, ...] = tuple(pages)
        self.block_bytes = block_cursor
        self.block_planes: tuple[int, ...] = (block_cursor,)  # one plane: a block is one byte range
        self.num_groups = 1  # one block table per request (``kvcache.PlanarLayout`` may have several)
        self.plane_groups: tuple[tuple[int, ...], ...] = ((0,),)
        self.ring_slot_bytes = self.ring_row_bytes * len(pages)
        self.ring_block_bytes = self.ring_slot_bytes * self.ring_slots
        self._by_name = {p.name: p for p in pages}
        # The fields of the blocks: MLA, then kpool entry and scale, or the QSA keys. Two layouts of one cache
        # (differing in block size, order or kernel page) give the same kinds, heads and pieces in the same order.
        self.fields: tuple[FieldGeometry, ...] = self._fields()

    def field(self, kind: FieldKind) -> FieldGeometry:
        """The geometry of one field (ValueError naming the kind when this family's pages do not hold it)."""
        for f in self.fields:
            if f.kind is kind:
                return f
        raise ValueError(f"a {self.config.family.value} block holds no {kind.value} field")

    def _fields(self) -> tuple[FieldGeometry, ...]:
        config, first = self.config, self.layers[0]
        # every layer's pages are one block_cursor step after the previous layer's
        layer_stride = self.layers[1].mla_offset - first.mla_offset if len(self.layers) > 1 else 0
        mla = config.mla
        fields = [_ordered(FieldKind.MLA, tokens_per_row=1, base=first.mla_offset, layer_stride=layer_stride,
                           rows=mla.block_size, heads=mla.num_heads, piece=mla.entry_bytes, order=mla.order)]
        family = config.family_spec
        if isinstance(family, KpoolFamilySpec):
            per_page = family.states_per_page
            for kind, start, piece in ((FieldKind.KPOOL_ENTRY, 0, INDEX_HEAD_DIM),
                                       (FieldKind.KPOOL_SCALE, per_page * INDEX_HEAD_DIM, KPOOL_SCALE_BYTES)):
                fields.append(FieldGeometry(
                    kind=kind, tokens_per_row=family.tokens_per_entry, base=first.indexer_offset + start,
                    layer_stride=layer_stride, rows_per_block=family.entries_per_block, rows_per_page=per_page,
                    page_stride=family.indexer.kernel_page_bytes, row_stride=piece, heads=1, head_stride=0,
                    piece_bytes=piece))
        else:
            keys = family.keys
            fields.append(_ordered(FieldKind.QSA_KEYS, tokens_per_row=keys.compress_ratio, base=first.indexer_offset,
                                   layer_stride=layer_stride, rows=keys.rows_per_block, heads=keys.num_heads,
                                   piece=keys.head_size * keys.element_bytes, order=keys.order))
        return tuple(fields)

    def layer(self, key: int | str) -> LayerPages:
        """A layer's pages by index or by name (KeyError/IndexError naming the key)."""
        if isinstance(key, str):
            if key not in self._by_name:
                raise KeyError(f"no layer named {key!r}; layers are {list(self._by_name)}")
            return self._by_name[key]
        if not 0 <= key < len(self.layers):
            raise IndexError(f"layer index {key} out of range [0, {len(self.layers)})")
        return self.layers[key]

    @functools.cached_property
    def layout_hash(self) -> str:
        """``layout_hash(config)``, worked out once (the config is frozen; a pull compares two of them)."""
        return layout_hash(self.config)

    def describe(self) -> dict[str, object]:
        """Plain description (sent in the connector's handshake and printed by the CLI)."""
        return self.config.hash_fields() | {
            "block_bytes": self.block_bytes,
            "ring_block_bytes": self.ring_block_bytes,
            "ring_slot_bytes": self.ring_slot_bytes,
            "layout_hash": self.layout_hash,
        }


def layout_hash(config: CacheConfig) -> str:
    """sha256 (hex) over every parameter that changes the bytes of a block or a ring block."""
    canonical = json.dumps(config.hash_fields(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def layout_differences(ours: dict[str, object], theirs: dict[str, object]) -> list[str]:
    """Names of the hashed fields whose values differ (the connector's refusal message)."""
    keys = sorted(set(ours) | set(theirs))
    return [k for k in keys if ours.get(k) != theirs.get(k)]
