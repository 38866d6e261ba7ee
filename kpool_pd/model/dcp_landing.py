"""A request's prefilled state moved onto one DCP rank inside one process: the rank's own tokens'
MLA bytes and its own complete pools' entries at their local positions, and the whole ring.

This is what the connector's per-rank plan moves over the wire (``kpool_pd.connector.shared.plan``); this copy is
for runs without a transfer (the in-process DCP reference, the model's tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kpool_pd.kvcache import CachePool, DcpShard


def land_request(source: CachePool, source_blocks: Sequence[int], source_ring: int, target: CachePool,
                 target_blocks: Sequence[int], target_ring: int, shard: DcpShard, length: int) -> None:
    """Copy the state of positions [0, ``length``) that ``shard`` holds from a whole-request pool
    (``source``: global positions) to a rank's pool (``target``: local positions), and the ring.
    ValueError when the two pools' cache configs differ or the target blocks are too few."""
    if source.config != target.config:
        raise ValueError("the source and target pools must share one cache config")
    cache = source.config
    block_size, kpool = cache.block_size, cache.tokens_per_entry
    need = shard.blocks_for_tokens(cache, length)
    if len(target_blocks) < need:
        raise ValueError(f"rank {shard.rank} holds {shard.owned_tokens(length)} of {length} tokens: it needs "
                         f"{need} blocks, got {len(target_blocks)}")
    device = "cpu"  # index tensors; they index either pool
    src = torch.tensor(list(source_blocks), dtype=torch.int64)
    dst = torch.tensor(list(target_blocks), dtype=torch.int64)
    local = torch.arange(shard.owned_tokens(length), device=device)
    glob = shard.global_position(local)
    own_pools = shard.owned_tokens(cache.complete_entries(length) * kpool) // kpool
    local_pool = torch.arange(own_pools, device=device)
    global_pool = shard.global_position(local_pool * kpool) // kpool
    states = cache.family_spec.entries_per_block
    for layer in range(cache.num_layers):
        target.mla(layer)[dst[local // block_size], local % block_size] = \
            source.mla(layer)[src[glob // block_size], glob % block_size].to(target.device)
        for view in ("indexer_q", "indexer_scale"):
            theirs, ours = getattr(source, view)(layer), getattr(target, view)(layer)
            ours[_entry(dst, local_pool, states, ours)] = theirs[_entry(src, global_pool, states, theirs)].to(target.device)
    target.rings[target_ring] = source.rings[source_ring].to(target.device)


def _entry(blocks: torch.Tensor, pools: torch.Tensor, states: int, view: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Index of each pool's entry in an indexer view: (block, kernel page, entry in the page).

    # blocks: [M] int64 (the block table); pools: [P] int64; view: [num_blocks, pages, per_page, ...]
    """
    per_page = view.shape[2]
    state = pools % states
    return blocks[pools // states], state // per_page, state % per_page
