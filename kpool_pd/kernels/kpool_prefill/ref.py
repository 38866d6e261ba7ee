"""Reference prefill of a batch of chunks: compress every pool a chunk completes into the paged
indexer cache and leave each request's open pool in its tail ring.

Request b's chunk covers positions ``[s, e)`` with ``s = start_pos[b]`` (0 for a whole prompt) and
``e = s + its token count``. It completes pools ``s // kpool .. e // kpool - 1``; the first of them
may straddle ``s``: its positions below ``s`` are read from the ring, which holds the open pool
after the previous chunk (DESIGN section 2, "Chunked prefill"). Every read happens before the ring
is written.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.kpool_cache.ref import block_states, pool_slots, write_entries
from kpool_pd.kernels.kpool_compress.ref import compress_pools
from kpool_pd.kvcache import PoolMode, open_entry_start


def prefill_compress_write(
    k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, query_start_loc: torch.Tensor, start_pos: torch.Tensor,
    block_table: torch.Tensor, ring_ids: torch.Tensor, tail_ring: torch.Tensor, indexer_q: torch.Tensor,
    indexer_scale: torch.Tensor, *, mode: PoolMode, round_scale: bool,
) -> None:
    """# k, gate: [T, 128] bf16; ape: [kpool, 128] fp32; query_start_loc: [B+1] int; start_pos: [B] int
    # block_table: [B, M] int; ring_ids: [B] int; tail_ring: [num_rings, 2, R, 128] bf16 (read only)
    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages,
    #   states_per_page] fp32 (written in place)
    """
    kpool, states, ring_size = ape.shape[0], block_states(indexer_q), tail_ring.shape[2]
    starts, firsts, rings = query_start_loc.tolist(), start_pos.tolist(), ring_ids.tolist()
    k_rows, g_rows, slot_rows = [], [], []
    for b in range(len(starts) - 1):
        first, end = firsts[b], firsts[b] + starts[b + 1] - starts[b]
        pools = torch.arange(first // kpool, end // kpool, device=k.device)
        if pools.numel() == 0:
            continue
        positions = pools[:, None] * kpool + torch.arange(kpool, device=k.device)  # [P, kpool]
        fresh = positions >= first
        token = (starts[b] + positions - first).clamp(min=0)
        slot = positions % ring_size
        ring = max(rings[b], 0)
        k_rows.append(torch.where(fresh[..., None], k[token], tail_ring[ring, 0, slot]))
        g_rows.append(torch.where(fresh[..., None], gate[token], tail_ring[ring, 1, slot]))
        slot_rows.append(pool_slots(block_table[b:b + 1], pools[None], kpool=kpool, states=states)[0])
    if not k_rows:
        return
    q, scale = compress_pools(torch.cat(k_rows), torch.cat(g_rows), ape, mode=mode, round_scale=round_scale)
    write_entries(indexer_q, indexer_scale, q, scale, torch.cat(slot_rows))


def seed_tail_ring(
    k: torch.Tensor, gate: torch.Tensor, query_start_loc: torch.Tensor, start_pos: torch.Tensor, ring_ids: torch.Tensor,
    tail_ring: torch.Tensor, *, kpool: int,
) -> None:
    """Write the chunk's tokens of each request's open pool (positions [max(floor(e/kpool)*kpool, s), e))
    at ring slots pos % R; the open pool's older tokens are in the ring already.

    # k, gate: [T, 128] bf16; query_start_loc: [B+1] int; start_pos: [B] int; ring_ids: [B] int (-1 = skip)
    # tail_ring: [num_rings, 2, R, 128] bf16 (written in place)
    """
    ring_size = tail_ring.shape[2]
    starts, firsts = query_start_loc.tolist(), start_pos.tolist()
    for b, ring_id in enumerate(ring_ids.tolist()):
        first, end = firsts[b], firsts[b] + starts[b + 1] - starts[b]
        lowest = max(open_entry_start(end, kpool), first)
        if ring_id < 0 or lowest == end:
            continue
        positions = torch.arange(lowest, end, device=k.device)
        tail_ring[ring_id, 0, positions % ring_size] = k[starts[b] + positions - first]
        tail_ring[ring_id, 1, positions % ring_size] = gate[starts[b] + positions - first]
