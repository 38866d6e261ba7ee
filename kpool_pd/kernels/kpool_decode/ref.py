"""Reference decode step update with drafts (DESIGN section 2, "Decode step").

Per request, the step's tokens sit at consecutive positions from ``start_pos``. In position
order each token's K and gate are stashed at ring slot pos % R; a token with
pos % kpool == kpool - 1 completes its pool, which is compressed from the ring and written to
the paged indexer cache (skipped where the block table holds -1, e.g. drafts past the blocks
the request holds). Rejected drafts are simply overwritten by the next step.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.kpool_cache.ref import block_states, pool_slots, write_entries
from kpool_pd.kernels.kpool_compress.ref import compress_pools
from kpool_pd.kvcache import PoolMode


def decode_update(
    k: torch.Tensor, gate: torch.Tensor, start_pos: torch.Tensor, query_start_loc: torch.Tensor,
    ring_ids: torch.Tensor, block_table: torch.Tensor, ape: torch.Tensor, tail_ring: torch.Tensor,
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, mode: PoolMode, round_scale: bool,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """# k, gate: [T, 128] bf16; start_pos: [B] int; query_start_loc: [B+1] int; ring_ids: [B] int
    # slot_mapping: [T] int64 or None: the indexer slot of the pool each token closes (-1 = none), from
    #   ``KpoolMetadata``; None locates each pool from the block table
    # block_table: [B, M] int; ape: [kpool, 128] fp32; tail_ring: [num_rings, 2, R, 128] bf16
    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages,
    #   states_per_page] fp32 (all written in place)
    """
    kpool, ring_size, states = ape.shape[0], tail_ring.shape[2], block_states(indexer_q)
    starts = query_start_loc.tolist()
    for b, (ring_id, first) in enumerate(zip(ring_ids.tolist(), start_pos.tolist())):
        for i in range(starts[b + 1] - starts[b]):
            pos, token = first + i, starts[b] + i
            tail_ring[ring_id, 0, pos % ring_size] = k[token]
            tail_ring[ring_id, 1, pos % ring_size] = gate[token]
            if pos % kpool != kpool - 1:
                continue
            ring_slots = torch.arange(pos - kpool + 1, pos + 1, device=k.device) % ring_size
            pool_k = tail_ring[ring_id, 0, ring_slots][None]
            pool_gate = tail_ring[ring_id, 1, ring_slots][None]
            q, scale = compress_pools(pool_k, pool_gate, ape, mode=mode, round_scale=round_scale)
            if slot_mapping is not None:
                slots = slot_mapping[token:token + 1]
            else:
                pool = torch.tensor([[pos // kpool]], device=k.device)
                slots = pool_slots(block_table[b:b + 1], pool, kpool=kpool, states=states)[0]
            write_entries(indexer_q, indexer_scale, q, scale, slots)
