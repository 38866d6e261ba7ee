"""Token-range repack (plain torch): the rows of positions ``[0, n)`` copied between two layouts of one
cache that may differ in block size, block order and kernel page size.

Stated through each layout's fields (``BlockLayout.fields``: MLA, then kpool entry and scale, or the QSA
keys), each read as a ``[blocks, pages, rows_per_page, heads, piece]`` view in logical order whatever the
storage order. Row ``g`` of a field (first token ``f = g * tokens_per_row``: a token, a pool, a group) lives
in block ``ids[f // block_size]``, row ``t = (f % block_size) // tokens_per_row`` of it, at
``[.., t // rows_per_page, t % rows_per_page]`` (DESIGN sections 2 and 3).

A row is copied when its first token is below ``n`` (so a partly filled pool or group moves too).
Nothing else of the destination is written. The ids must be valid and the destination ids distinct
(the public op checks that on CPU).
"""

from __future__ import annotations

import torch

from kpool_pd.kvcache import BlockLayout, FieldGeometry


def _places(ids: torch.Tensor, block_size: int, field: FieldGeometry, num_tokens: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # ids: [blocks] int64 -> (block id, page, row in the page): each [rows of positions [0, num_tokens)] int64
    firsts = torch.arange(0, num_tokens, field.tokens_per_row, device=ids.device)  # first token of each row
    row = (firsts % block_size) // field.tokens_per_row
    return ids[firsts // block_size], row // field.rows_per_page, row % field.rows_per_page


def repack_tokens(src_blocks: torch.Tensor, src_layout: BlockLayout, src_ids: torch.Tensor,
                  dst_blocks: torch.Tensor, dst_layout: BlockLayout, dst_ids: torch.Tensor, num_tokens: int) -> None:
    # src_blocks: [Ns, src block_bytes] uint8; dst_blocks: [Nd, dst block_bytes] uint8 (in place);
    # src_ids: [>= ceil(n / src block_size)] int; dst_ids: [>= ceil(n / dst block_size)] int; n = num_tokens
    if num_tokens == 0:
        return
    src_ids, dst_ids = src_ids.to(torch.int64), dst_ids.to(torch.int64)
    for src_field, dst_field in zip(src_layout.fields, dst_layout.fields, strict=True):
        src_at = _places(src_ids, src_layout.config.block_size, src_field, num_tokens)
        dst_at = _places(dst_ids, dst_layout.config.block_size, dst_field, num_tokens)
        for layer in range(len(src_layout.layers)):
            # [rows, heads, piece] uint8 each side
            dst_field.view(dst_blocks, layer)[dst_at] = src_field.view(src_blocks, layer)[src_at]
