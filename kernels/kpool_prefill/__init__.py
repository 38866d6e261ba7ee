"""Prefill of a batch: compress + paged write of every complete pool, and tail-ring seeding."""

from __future__ import annotations

import torch

from kernels.checks import as_pool_mode, check_int_tensor, check_same_device
from kernels.dispatch import on_tensor_device, use_triton
from kernels.kpool_checks import check_kpool_cache, check_tail_ring, check_token_batch
from kernels.kpool_prefill.ref import prefill_compress_write, seed_tail_ring
from kvcache import PoolMode


@on_tensor_device
def kpool_prefill(
    k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, query_start_loc: torch.Tensor,
    block_table: torch.Tensor, ring_ids: torch.Tensor, indexer_q: torch.Tensor, indexer_scale: torch.Tensor,
    tail_ring: torch.Tensor, *, mode: PoolMode | str = "softmax", round_scale: bool = True,
) -> None:
    """Prefill B whole prompts (each from position 0) in place: Triton on CUDA tensors (two launches, no host
    synchronisation), the torch reference on CPU (see kernels.dispatch).

    # k, gate: [T, 128] bf16; ape: [kpool, 128] fp32; query_start_loc: [B+1] int; block_table: [B, M] int
    # ring_ids: [B] int (-1 = no ring); indexer_q: [num_blocks, S, 128] fp8; indexer_scale: [num_blocks, S] fp32
    # tail_ring: [num_rings, 2, R, 128] bf16
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
    check_same_device(k=k, ape=ape, query_start_loc=query_start_loc, block_table=block_table, indexer_q=indexer_q,
                      tail_ring=tail_ring)
    if use_triton(k):
        from kernels.kpool_prefill.triton import prefill_compress_write_triton, seed_tail_ring_triton

        prefill_compress_write_triton(k, gate, ape, query_start_loc, block_table, indexer_q, indexer_scale, mode=mode,
                                      round_scale=round_scale)
        seed_tail_ring_triton(k, gate, query_start_loc, ring_ids, tail_ring, kpool=kpool)
        return
    prefill_compress_write(k, gate, ape, query_start_loc, block_table, indexer_q, indexer_scale, mode=mode,
                           round_scale=round_scale)
    seed_tail_ring(k, gate, query_start_loc, ring_ids, tail_ring, kpool=kpool)
