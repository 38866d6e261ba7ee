"""One forward's kpool metadata, pool-granular, as the seed's metadata builder emits it for a compressed cache
whose ``compress_ratio`` equals the pool size: per token the slot of the indexer entry it completes, per request
its complete pools, and the request's kernel pages.

For ``compress_ratio == kpool`` the seed's compressed slot of the token at position ``pos`` is
``block_table[pos // block_size] * (block_size // kpool) + (pos % block_size) // kpool`` where
``(pos + 1) % kpool == 0`` (the token closes its pool), and -1 elsewhere; that is ``block * S + pool % S``
with ``S = block_size / kpool`` states a block, the slot ``kpool_pd.kernels.kpool_cache`` reads and writes.
Plain torch on any device, without a host synchronisation once ``num_tokens`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, eq=False)
class KpoolMetadata:
    """What the kpool ops locate a forward's bytes by, built once per step (``build_kpool_metadata``).

    # slot_mapping: [T] int64, the indexer slot (block * S + state) of the pool that token t completes;
    #   -1 where it completes none, or where its block is -1 (a draft past the request's blocks)
    # seq_lens: [B] int32, the complete pools of each request after the forward: seq_len // kpool
    # page_table: [B, M * pages_per_block] int32, each request's kernel pages in order
    #   (block * pages_per_block + page; -1 where the block is -1)
    # block_table: [B, M] int32, the blocks the pages come from
    """

    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    block_table: torch.Tensor
    kpool: int
    states_per_block: int
    pages_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def build_kpool_metadata(query_start_loc: torch.Tensor, start_pos: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, *, kpool: int, block_size: int, pages_per_block: int,
                         num_tokens: int) -> KpoolMetadata:
    """# query_start_loc: [B+1] int; start_pos, seq_lens: [B] int; block_table: [B, M] int (-1 padded)
    # -> KpoolMetadata over T = num_tokens tokens (request b's at query_start_loc[b]: from position start_pos[b])
    """
    device = query_start_loc.device
    batch, width = block_table.shape
    states = block_size // kpool
    starts = query_start_loc.to(torch.int64)
    counts = starts[1:] - starts[:-1]
    request = torch.repeat_interleave(torch.arange(batch, device=device), counts, output_size=num_tokens)  # [T]
    positions = start_pos.to(torch.int64)[request] + torch.arange(num_tokens, device=device) - starts[request]
    pool = positions // kpool
    column = pool // states
    table = block_table.to(torch.int64)
    block = torch.where(column < width, table[request, column.clamp(max=max(width - 1, 0))], -1)
    closes = ((positions + 1) % kpool == 0) & (block >= 0)
    slot_mapping = torch.where(closes, block * states + pool % states, -1)
    pages = table[:, :, None] * pages_per_block + torch.arange(pages_per_block, device=device)  # [B, M, pages]
    page_table = torch.where(table[:, :, None] >= 0, pages, -1).reshape(batch, width * pages_per_block)
    return KpoolMetadata(slot_mapping=slot_mapping, seq_lens=(seq_lens.to(torch.int64) // kpool).to(torch.int32),
                         page_table=page_table.to(torch.int32), block_table=block_table.to(torch.int32), kpool=kpool,
                         states_per_block=states, pages_per_block=pages_per_block)
