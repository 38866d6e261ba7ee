"""Reference prefill of a batch: compress every complete pool into the paged indexer cache and
seed each request's tail ring with its open pool. Each request's prompt starts at position 0.
"""

from __future__ import annotations

import torch

from kernels.kpool_cache.ref import pool_slots, write_entries
from kernels.kpool_compress.ref import compress_pools
from kvcache import PoolMode, complete_entries, open_entry_start


def prefill_compress_write(
    k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, query_start_loc: torch.Tensor, block_table: torch.Tensor,
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, mode: PoolMode, round_scale: bool,
) -> None:
    """# k, gate: [T, 128] bf16; ape: [kpool, 128] fp32; query_start_loc: [B+1] int; block_table: [B, M] int
    # indexer_q: [num_blocks, S, 128] fp8; indexer_scale: [num_blocks, S] fp32 (written in place)
    """
    kpool, states = ape.shape[0], indexer_q.shape[1]
    starts = query_start_loc.tolist()
    token_rows, slot_rows = [], []
    for b in range(len(starts) - 1):
        pools = complete_entries(starts[b + 1] - starts[b], kpool)
        if pools == 0:
            continue
        token_rows.append(starts[b] + torch.arange(pools * kpool, device=k.device).view(pools, kpool))
        pool_ids = torch.arange(pools, device=k.device)[None]
        slot_rows.append(pool_slots(block_table[b:b + 1], pool_ids, kpool=kpool, states=states)[0])
    if not token_rows:
        return
    tokens = torch.cat(token_rows)
    q, scale = compress_pools(k[tokens], gate[tokens], ape, mode=mode, round_scale=round_scale)
    write_entries(indexer_q, indexer_scale, q, scale, torch.cat(slot_rows))


def seed_tail_ring(
    k: torch.Tensor, gate: torch.Tensor, query_start_loc: torch.Tensor, ring_ids: torch.Tensor, tail_ring: torch.Tensor,
    *, kpool: int,
) -> None:
    """Write each request's open pool (positions [floor(L/kpool)*kpool, L)) at ring slots pos % R.

    # k, gate: [T, 128] bf16; query_start_loc: [B+1] int; ring_ids: [B] int (-1 = skip)
    # tail_ring: [num_rings, 2, R, 128] bf16 (written in place)
    """
    ring_size = tail_ring.shape[2]
    starts = query_start_loc.tolist()
    for b, ring_id in enumerate(ring_ids.tolist()):
        length = starts[b + 1] - starts[b]
        first = open_entry_start(length, kpool)
        if ring_id < 0 or first == length:
            continue
        positions = torch.arange(first, length, device=k.device)
        tail_ring[ring_id, 0, positions % ring_size] = k[starts[b] + positions]
        tail_ring[ring_id, 1, positions % ring_size] = gate[starts[b] + positions]
