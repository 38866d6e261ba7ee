"""Block repack between the BLNHC and BLHNC orders (plain torch).

Two workers whose cache configs differ only in ``order`` store the same values in different byte
orders: per layer, the MLA page is ``[N tokens, H heads, C bytes]`` (BLNHC) or ``[H, N, C]`` (BLHNC),
and the QSA compressed-key page is ``[rows, H, D * elt]`` or ``[H, rows, D * elt]``. The kpool
indexer page and the rings hold no head axis and are the same in both orders (rings are not
blocks and are not touched here). A repack copies each page of source block ``src_ids[i]`` into
destination block ``dst_ids[i]``, transposing the two middle axes where the orders differ and
copying the bytes where they are equal. Only page bytes are written; the alignment padding
between pages keeps whatever the destination held.

A page is one ``Segment``: ``layers`` pages ``layer_stride`` bytes apart, starting at ``offset``,
each stored ``[a, b, row_bytes]`` in the source and ``[b, a, row_bytes]`` in the destination
(``a = 1`` for a plain copy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvcache import BlockLayout, BlockOrder


@dataclass(frozen=True)
class Segment:
    """One page kind of every layer: source ``[a, b, row_bytes]`` -> destination ``[b, a, row_bytes]``."""

    offset: int
    layer_stride: int
    layers: int
    a: int
    b: int
    row_bytes: int

    @property
    def page_bytes(self) -> int:
        return self.a * self.b * self.row_bytes

    def page_offsets(self) -> list[int]:
        return [self.offset + layer * self.layer_stride for layer in range(self.layers)]


def _layer_stride(offsets: list[int]) -> int:
    stride = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    assert all(o == offsets[0] + i * stride for i, o in enumerate(offsets)), offsets
    return stride


def _transposed(offset: int, stride: int, layers: int, tokens: int, heads: int, row_bytes: int,
                src_order: BlockOrder, dst_order: BlockOrder) -> Segment:
    if src_order is dst_order or heads == 1:  # the same bytes: a copy (one page-long row)
        return Segment(offset, stride, layers, 1, 1, tokens * heads * row_bytes)
    if src_order is BlockOrder.BLNHC:
        return Segment(offset, stride, layers, tokens, heads, row_bytes)
    return Segment(offset, stride, layers, heads, tokens, row_bytes)


def repack_segments(src_layout: BlockLayout, dst_layout: BlockLayout) -> tuple[Segment, ...]:
    """The pages a repack moves, as segments (the layouts must differ at most in ``order``)."""
    check_layouts(src_layout, dst_layout)
    config = src_layout.config
    src_order, dst_order = config.order, dst_layout.config.order
    layers = len(src_layout.layers)
    mla = config.mla
    mla_offsets = [p.mla_offset for p in src_layout.layers]
    segments = [_transposed(mla_offsets[0], _layer_stride(mla_offsets), layers, mla.block_size, mla.num_heads,
                            mla.entry_bytes, src_order, dst_order)]
    index_offsets = [p.indexer_offset for p in src_layout.layers]
    rows, heads, row_bytes = config.family_spec.page_axes
    segments.append(_transposed(index_offsets[0], _layer_stride(index_offsets), layers, rows, heads, row_bytes,
                                src_order, dst_order))
    return tuple(segments)


def check_layouts(src_layout: BlockLayout, dst_layout: BlockLayout) -> None:
    for name, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        if not isinstance(layout, BlockLayout):
            raise TypeError(f"{name} must be a BlockLayout, got {type(layout).__name__}")
    same_but_order = replace(src_layout.config, order=dst_layout.config.order)
    if same_but_order != dst_layout.config:
        ours, theirs = src_layout.config.hash_fields(), dst_layout.config.hash_fields()
        fields = sorted(k for k in set(ours) | set(theirs) if k != "order" and ours.get(k) != theirs.get(k))
        raise ValueError(f"the layouts may differ only in order; they also differ in {fields}")


def repack_blocks(
    src_blocks: torch.Tensor, src_layout: BlockLayout, src_ids: torch.Tensor,
    dst_blocks: torch.Tensor, dst_layout: BlockLayout, dst_ids: torch.Tensor,
) -> None:
    # src_blocks: [Ns, block_bytes] uint8; dst_blocks: [Nd, block_bytes] uint8 (in place); src_ids, dst_ids: [n] int
    n = src_ids.shape[0]
    src_rows = src_blocks[src_ids.to(torch.int64)]  # [n, block_bytes], a gathered copy
    dst_index = dst_ids.to(torch.int64)
    for seg in repack_segments(src_layout, dst_layout):
        for offset in seg.page_offsets():
            page = src_rows[:, offset:offset + seg.page_bytes].view(n, seg.a, seg.b, seg.row_bytes)
            dst_blocks[dst_index, offset:offset + seg.page_bytes] = page.transpose(1, 2).reshape(n, seg.page_bytes)
