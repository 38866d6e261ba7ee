"""Prefill of a batch of chunks: compress + paged write of every pool each chunk completes, and the
tail ring left holding each request's open pool."""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import as_pool_mode, check_int_tensor, check_same_device
from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.kpool_checks import check_kpool_cache, check_tail_ring, check_token_batch
from kpool_pd.kernels.kpool_prefill.ref import prefill_compress_write, seed_tail_ring
from kpool_pd.kvcache import PoolMode


@on_tensor_device
def kpool_prefill(
    k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, query_start_loc: torch.Tensor,
    block_table: torch.Tensor, ring_ids: torch.Tensor, indexer_q: torch.Tensor, indexer_scale: torch.Tensor,
    tail_ring: torch.Tensor, *, mode: PoolMode | str = "softmax", round_scale: bool = True,
    start_pos: torch.Tensor | None = None, pool_offsets: torch.Tensor | None = None,
) -> None:
    """Prefill B chunks in place: request b's tokens sit at positions start_pos[b], start_pos[b] + 1, ...
    (``start_pos`` None: every chunk is a whole prompt from position 0). Every pool a chunk completes is
    compressed and written; the first may straddle the chunk start, its older positions read from the ring
    (which holds the open pool after the request's previous chunk); then the ring is left holding the open
    pool after the chunk. Triton on CUDA tensors (two launches, no host synchronisation), the torch
    reference on CPU (see kernels.dispatch). A chunk that starts inside a pool needs a ring (ring id >= 0):
    ValueError on CPU tensors; on CUDA, ring 0 would be read.

    # k, gate: [T, 128] bf16; ape: [kpool, 128] fp32; query_start_loc: [B+1] int; block_table: [B, M] int
    # ring_ids: [B] int (-1 = no ring); indexer_q: [num_blocks, pages, states_per_page, 128] fp8
    # indexer_scale: [num_blocks, pages, states_per_page] fp32 (the kernel pages: CachePool.indexer_q / indexer_scale)
    # tail_ring: [num_rings, 2, R, 128] bf16; start_pos: [B] int or None
    # pool_offsets: [B+1] int64 or None, ``prefill_pool_offsets`` of these chunks (a forward computes it once for
    #   every layer; None: computed here)
    """
    mode = as_pool_mode(mode)
    batch = check_token_batch(k, gate, query_start_loc)
    kpool = check_kpool_cache(ape, indexer_q, indexer_scale)
    check_tail_ring(tail_ring, kpool)
    check_int_tensor("block_table", block_table, 2)
    check_int_tensor("ring_ids", ring_ids, 1)
    if block_table.shape[0] != batch or ring_ids.shape[0] != batch:
        raise ValueError(
            f"batch of {batch} requests needs block_table and ring_ids rows for each, got "
            f"{block_table.shape[0]} and {ring_ids.shape[0]}"
        )
    chunked = start_pos is not None
    if chunked:
        check_int_tensor("start_pos", start_pos, 1)
        if start_pos.shape[0] != batch:
            raise ValueError(f"start_pos must have {batch} rows (one per request), got shape {tuple(start_pos.shape)}")
    else:
        start_pos = torch.zeros(batch, dtype=torch.int64, device=k.device)
    check_same_device(k=k, ape=ape, query_start_loc=query_start_loc, block_table=block_table, indexer_q=indexer_q,
                      tail_ring=tail_ring, start_pos=start_pos)
    if chunked and not k.is_cuda:
        _check_chunk_values(start_pos, ring_ids, tail_ring.shape[0], kpool)
    if use_triton(k):
        from kpool_pd.kernels.kpool_prefill.triton import prefill_compress_write_triton, seed_tail_ring_triton

        if pool_offsets is None:
            pool_offsets = prefill_pool_offsets(query_start_loc, start_pos if chunked else None, kpool)
        elif pool_offsets.shape != (batch + 1,) or pool_offsets.dtype != torch.int64:
            raise ValueError(f"pool_offsets must be int64 of shape ({batch + 1},), got {pool_offsets.dtype} "
                             f"{tuple(pool_offsets.shape)}")
        prefill_compress_write_triton(k, gate, ape, query_start_loc, start_pos if chunked else None, pool_offsets,
                                      block_table, ring_ids, tail_ring, indexer_q, indexer_scale, mode=mode,
                                      round_scale=round_scale)
        seed_tail_ring_triton(k, gate, query_start_loc, start_pos, ring_ids, tail_ring, kpool=kpool)
        return
    prefill_compress_write(k, gate, ape, query_start_loc, start_pos, block_table, ring_ids, tail_ring, indexer_q,
                           indexer_scale, mode=mode, round_scale=round_scale)
    seed_tail_ring(k, gate, query_start_loc, start_pos, ring_ids, tail_ring, kpool=kpool)


def prefill_pool_offsets(query_start_loc: torch.Tensor, start_pos: torch.Tensor | None, kpool: int) -> torch.Tensor:
    """Where each chunk's completed pools start among the batch's: chunk b completes the pools from
    ``start_pos[b] // kpool`` up to ``(start_pos[b] + its tokens) // kpool`` (``start_pos`` None: from 0).

    # query_start_loc: [B+1] int; start_pos: [B] int or None -> [B+1] int64 (offsets[0] = 0)
    """
    qsl = query_start_loc.to(torch.int64)
    counts = qsl[1:] - qsl[:-1]
    if start_pos is not None:
        first = start_pos.to(torch.int64)
        pools = (first + counts) // kpool - first // kpool
    else:
        pools = counts // kpool
    offsets = torch.zeros(qsl.shape[0], dtype=torch.int64, device=qsl.device)
    torch.cumsum(pools, 0, out=offsets[1:])
    return offsets


def _check_chunk_values(start_pos: torch.Tensor, ring_ids: torch.Tensor, num_rings: int, kpool: int) -> None:
    """# start_pos, ring_ids: [B] int (CPU): positions >= 0; a chunk starting inside a pool has a ring."""
    if start_pos.numel() and int(start_pos.min()) < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos.tolist()[:8]}")
    straddles = (start_pos % kpool != 0) & ((ring_ids < 0) | (ring_ids >= num_rings))
    if bool(straddles.any()):
        b = int(torch.nonzero(straddles)[0, 0])
        raise ValueError(f"request {b} starts at position {int(start_pos[b])}, inside a pool of {kpool}: it needs a "
                         f"ring in [0, {num_rings}), got ring id {int(ring_ids[b])}")
