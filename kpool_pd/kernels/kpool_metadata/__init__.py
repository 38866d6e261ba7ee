"""The kpool ops' per-forward metadata (``KpoolMetadata``): pool-granular slot mapping, complete pools per request
and kernel page table, built once per step by ``build_kpool_metadata`` and handed to every layer's op
(``kpool_decode_update(..., metadata=)``, ``kpool_prefill(..., metadata=)``)."""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor, check_same_device
from kpool_pd.kernels.kpool_metadata.ref import KpoolMetadata
from kpool_pd.kernels.kpool_metadata.ref import build_kpool_metadata as _build


def build_kpool_metadata(query_start_loc: torch.Tensor, start_pos: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, *, kpool: int, block_size: int, pages_per_block: int = 1,
                         num_tokens: int | None = None) -> KpoolMetadata:
    """The metadata of one forward (``ref``): the same torch code on every device. ``num_tokens`` (T) fixes the
    output size without reading ``query_start_loc[-1]`` (on CUDA no host synchronisation then); None reads it.
    ValueError for a geometry or batch that cannot be one (values checked on CPU tensors only).

    # query_start_loc: [B+1] int; start_pos, seq_lens: [B] int; block_table: [B, M] int (-1 padded)
    """
    for name, value, least in (("kpool", kpool, 2), ("block_size", block_size, 1), ("pages_per_block", pages_per_block, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if block_size % kpool or (block_size // kpool) % pages_per_block:
        raise ValueError(f"block_size {block_size} must hold whole pools of {kpool} and its {block_size // kpool} "
                         f"states whole pages ({pages_per_block} a block)")
    check_int_tensor("query_start_loc", query_start_loc, 1)
    check_int_tensor("start_pos", start_pos, 1)
    check_int_tensor("seq_lens", seq_lens, 1)
    check_int_tensor("block_table", block_table, 2)
    batch = block_table.shape[0]
    if query_start_loc.shape[0] != batch + 1 or start_pos.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(f"a batch of {batch} requests needs query_start_loc [{batch + 1}], start_pos and seq_lens "
                         f"[{batch}], got {list(query_start_loc.shape)}, {list(start_pos.shape)}, {list(seq_lens.shape)}")
    check_same_device(query_start_loc=query_start_loc, start_pos=start_pos, seq_lens=seq_lens, block_table=block_table)
    if num_tokens is None:
        num_tokens = int(query_start_loc[-1])
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    if not query_start_loc.is_cuda:
        ends = start_pos.to(torch.int64) + query_start_loc[1:].to(torch.int64) - query_start_loc[:-1].to(torch.int64)
        if int(query_start_loc[-1]) != num_tokens or not torch.equal(ends, seq_lens.to(torch.int64)):
            raise ValueError(f"num_tokens {num_tokens} and seq_lens {seq_lens.tolist()} must be the batch's: "
                             f"query_start_loc {query_start_loc.tolist()} from start_pos {start_pos.tolist()}")
    return _build(query_start_loc, start_pos, seq_lens, block_table, kpool=kpool, block_size=block_size,
                  pages_per_block=pages_per_block, num_tokens=num_tokens)


__all__ = ["KpoolMetadata", "build_kpool_metadata"]
