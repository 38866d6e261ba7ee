"""Token-range repack (plain torch): the entries of positions ``[0, n)`` copied between two layouts of one
cache that may differ in block size, block order and kernel page size.

Stated through typed views of each layout's pages, in logical order whatever the storage order:

- MLA ``[blocks, block_size, H, C]``: position ``p`` lives at ``[ids[p // block_size], p % block_size]``;
- kpool entries ``[blocks, pages, states_per_page, 128]`` and scales ``[blocks, pages, states_per_page, 4]``:
  pool ``s`` (first token ``s * kpool``) lives in block ``ids[s * kpool // block_size]``, state
  ``t = (s * kpool % block_size) // kpool``, at ``[.., t // states_per_page, t % states_per_page]``
  (DESIGN section 2);
- QSA keys ``[blocks, rows, H, D * elt]``: group ``g`` lives in block ``ids[g * r // block_size]``,
  row ``(g * r % block_size) // r`` (DESIGN section 3).

A pool or group is copied when its first token is below ``n`` (so a partly filled one moves too).
Nothing else of the destination is written. The ids must be valid and the destination ids distinct
(the public op checks that on CPU).
"""

from __future__ import annotations

import torch

from kvcache import FP8_ENTRY_BYTES, INDEX_HEAD_DIM, BlockLayout, BlockOrder, KpoolFamilySpec


def _ordered_page(blocks: torch.Tensor, offset: int, rows: int, heads: int, piece: int,
                  order: BlockOrder) -> torch.Tensor:
    # blocks: [N, block_bytes] uint8 -> [N, rows, heads, piece] uint8 (logical order, aliases blocks)
    raw = blocks[:, offset:offset + rows * heads * piece]
    if order is BlockOrder.BLNHC:
        return raw.view(-1, rows, heads, piece)
    return raw.view(-1, heads, rows, piece).permute(0, 2, 1, 3)


def mla_view(blocks: torch.Tensor, layout: BlockLayout, layer: int) -> torch.Tensor:
    # blocks: [N, block_bytes] uint8 -> [N, block_size, H, C] uint8
    spec = layout.config.mla
    return _ordered_page(blocks, layout.layer(layer).mla_offset, spec.block_size, spec.num_heads, spec.entry_bytes,
                         spec.order)


def qsa_view(blocks: torch.Tensor, layout: BlockLayout, layer: int) -> torch.Tensor:
    # blocks: [N, block_bytes] uint8 -> [N, rows, H, D * elt] uint8
    keys = layout.config.qsa_keys
    return _ordered_page(blocks, layout.layer(layer).indexer_offset, keys.rows_per_block, keys.num_heads,
                         keys.head_size * keys.element_bytes, keys.order)


def kpool_views(blocks: torch.Tensor, layout: BlockLayout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    # blocks: [N, block_bytes] uint8 -> (q [N, pages, per_page, 128] uint8, scale [N, pages, per_page, 4] uint8)
    family = layout.config.family_spec
    per_page, pages = family.states_per_page, family.pages_per_block
    offset = layout.layer(layer).indexer_offset
    kernel_pages = blocks[:, offset:offset + family.page_bytes].view(-1, pages, per_page * FP8_ENTRY_BYTES)
    q = kernel_pages[:, :, :per_page * INDEX_HEAD_DIM].view(-1, pages, per_page, INDEX_HEAD_DIM)
    scale = kernel_pages[:, :, per_page * INDEX_HEAD_DIM:].view(-1, pages, per_page, FP8_ENTRY_BYTES - INDEX_HEAD_DIM)
    return q, scale


def _rows_of(ids: torch.Tensor, first_tokens: torch.Tensor, block_size: int, tokens_per_row: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    # ids: [blocks] int64; first_tokens: [n] int64 -> (block id [n], row inside the block [n])
    return ids[first_tokens // block_size], (first_tokens % block_size) // tokens_per_row


def repack_tokens(src_blocks: torch.Tensor, src_layout: BlockLayout, src_ids: torch.Tensor,
                  dst_blocks: torch.Tensor, dst_layout: BlockLayout, dst_ids: torch.Tensor, num_tokens: int) -> None:
    # src_blocks: [Ns, src block_bytes] uint8; dst_blocks: [Nd, dst block_bytes] uint8 (in place);
    # src_ids: [>= ceil(n / src block_size)] int; dst_ids: [>= ceil(n / dst block_size)] int; n = num_tokens
    if num_tokens == 0:
        return
    src_ids, dst_ids = src_ids.to(torch.int64), dst_ids.to(torch.int64)
    a, b = src_layout.config.block_size, dst_layout.config.block_size
    family = src_layout.config.family_spec
    per_row = family.tokens_per_entry
    tokens = torch.arange(num_tokens, device=src_blocks.device)
    firsts = torch.arange(0, num_tokens, per_row, device=src_blocks.device)  # first token of each pool / group
    src_tok, dst_tok = _rows_of(src_ids, tokens, a, 1), _rows_of(dst_ids, tokens, b, 1)
    src_row, dst_row = _rows_of(src_ids, firsts, a, per_row), _rows_of(dst_ids, firsts, b, per_row)
    for layer in range(len(src_layout.layers)):
        mla_view(dst_blocks, dst_layout, layer)[dst_tok] = mla_view(src_blocks, src_layout, layer)[src_tok]
        if isinstance(family, KpoolFamilySpec):
            src_pp = src_layout.config.family_spec.states_per_page
            dst_pp = dst_layout.config.family_spec.states_per_page
            src_at = (src_row[0], src_row[1] // src_pp, src_row[1] % src_pp)
            dst_at = (dst_row[0], dst_row[1] // dst_pp, dst_row[1] % dst_pp)
            for src_view, dst_view in zip(kpool_views(src_blocks, src_layout, layer),
                                          kpool_views(dst_blocks, dst_layout, layer)):
                dst_view[dst_at] = src_view[src_at]
        else:
            qsa_view(dst_blocks, dst_layout, layer)[dst_row] = qsa_view(src_blocks, src_layout, layer)[src_row]
