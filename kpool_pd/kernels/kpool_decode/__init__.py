"""Decode step update with drafts: stash in the tail ring, compress each completed pool, write it."""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import as_pool_mode, check_int_tensor, check_same_device
from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.kpool_decode.ref import decode_update
from kpool_pd.kernels.kpool_metadata import KpoolMetadata
from kpool_pd.kernels.kpool_checks import check_kpool_cache, check_tail_ring, check_token_batch
from kpool_pd.kvcache import PoolMode


@on_tensor_device
def kpool_decode_update(
    k: torch.Tensor, gate: torch.Tensor, start_pos: torch.Tensor, query_start_loc: torch.Tensor,
    ring_ids: torch.Tensor, block_table: torch.Tensor, ape: torch.Tensor, tail_ring: torch.Tensor,
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, mode: PoolMode | str = "softmax", round_scale: bool = True,
    metadata: KpoolMetadata | None = None,
) -> None:
    """One decode step for a batch, all draft tokens included, in place.

    ``metadata`` (``kpool_pd.kernels.kpool_metadata``, built once per step for every layer) gives each completed
    pool's slot (its ``slot_mapping`` at the token that closes the pool); None locates the pools from
    ``block_table``. The two write the same bytes.

    CUDA tensors run one Triton launch with no host synchronisation (CUDA-graph capturable), so the
    checks that read values (ring_ids within [0, num_rings)) run on CPU tensors only; on CUDA a
    negative ring id skips its request. CPU tensors run the torch reference (see kernels.dispatch).

    # k, gate: [T, 128] bf16 (request b's tokens at query_start_loc[b]:query_start_loc[b+1], positions
    #   start_pos[b], start_pos[b]+1, ...); start_pos: [B] int; query_start_loc: [B+1] int
    # ring_ids: [B] int; block_table: [B, M] int (-1 = no block: that pool's write is skipped)
    # ape: [kpool, 128] fp32; tail_ring: [num_rings, 2, R, 128] bf16
    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages, states_per_page]
    #   fp32 (the kernel pages: CachePool.indexer_q / indexer_scale)
    """
    mode = as_pool_mode(mode)
    batch = check_token_batch(k, gate, query_start_loc)
    kpool = check_kpool_cache(ape, indexer_q, indexer_scale)
    check_tail_ring(tail_ring, kpool)
    for name, t, rank in (("start_pos", start_pos, 1), ("ring_ids", ring_ids, 1), ("block_table", block_table, 2)):
        check_int_tensor(name, t, rank)
        if t.shape[0] != batch:
            raise ValueError(f"{name} must have {batch} rows (one per request), got shape {tuple(t.shape)}")
    check_same_device(k=k, start_pos=start_pos, ring_ids=ring_ids, block_table=block_table, tail_ring=tail_ring,
                      indexer_q=indexer_q)
    slot_mapping = None
    if metadata is not None:
        slot_mapping = _slot_mapping_of(metadata, k, indexer_q)
    if not k.is_cuda and ring_ids.numel():
        low, high = int(ring_ids.min()), int(ring_ids.max())
        if low < 0 or high >= tail_ring.shape[0]:
            raise ValueError(f"ring_ids must lie in [0, {tail_ring.shape[0]}), got range [{low}, {high}]")
    if use_triton(k):
        from kpool_pd.kernels.kpool_decode.triton import decode_update_triton

        decode_update_triton(k, gate, start_pos, query_start_loc, ring_ids, block_table, ape, tail_ring, indexer_q,
                             indexer_scale, mode=mode, round_scale=round_scale, slot_mapping=slot_mapping)
        return
    decode_update(k, gate, start_pos, query_start_loc, ring_ids, block_table, ape, tail_ring, indexer_q,
                  indexer_scale, mode=mode, round_scale=round_scale, slot_mapping=slot_mapping)


def _slot_mapping_of(metadata: KpoolMetadata, k: torch.Tensor, indexer_q: torch.Tensor) -> torch.Tensor:
    """The metadata's slot mapping, checked against the step's tokens and the cache's pages.

    # k: [T, 128]; indexer_q: [num_blocks, pages, states_per_page, 128] -> [T] int64
    """
    if not isinstance(metadata, KpoolMetadata):
        raise TypeError(f"metadata must be a KpoolMetadata, got {type(metadata).__name__}")
    states = indexer_q.shape[1] * indexer_q.shape[2]
    if metadata.num_tokens != k.shape[0] or metadata.states_per_block != states:
        raise ValueError(f"metadata of {metadata.num_tokens} tokens and {metadata.states_per_block} states a block "
                         f"does not fit a step of {k.shape[0]} tokens on a cache of {states} states a block")
    check_same_device(k=k, slot_mapping=metadata.slot_mapping)
    return metadata.slot_mapping.to(torch.int64).contiguous()
