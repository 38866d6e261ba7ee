"""The torch reference of one layer's hash: each family's features of a query row, built from its
selection and the cache bytes, folded into the chained hash by the rule (``kpool_pd.model.rule.fold_layer``).

A row's features, in order (every read that names nothing, a -1, gives zeros):

- kpool (g = kpool): the selected pools + 1 (``K``); each selected pool's fp8 entry, 128 code bytes then
  its fp32 scale's 4 bytes little-endian (``K * 132``); the ring rows of the open pool's positions
  ``[L // g * g, L)`` (``(g - 1) * ring_row_bytes``); the MLA bytes of every attended token: each
  selected pool's g tokens in rank order, then the open pool's positions (``(K * g + g - 1) * H * E``).
- QSA (g = compress ratio r): the chosen rows + 1; each chosen row's compressed key bytes ``[H, D]``;
  the open group's ring rows; the MLA bytes of ``token_indices`` (``qsa_topk``'s).

The families' ``features`` call these functions, so the engine's torch path and this reference are one code.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.kpool_cache.ref import pool_slots, read_entries
from kpool_pd.kvcache import FP8_ENTRY_BYTES
from kpool_pd.model.cache_io import gather_mla, gather_ring_rows, open_group_positions
from kpool_pd.model.rule import fold_layer


def kpool_features(pools: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, ring_ids: torch.Tensor,
                   indexer_q: torch.Tensor, indexer_scale: torch.Tensor, ring_rows: torch.Tensor, mla: torch.Tensor, *,
                   kpool: int) -> torch.Tensor:
    """One layer's kpool features of each row (module docstring).

    # pools: [Q, K] int64 (-1 = none); seq_lens: [Q] int; block_table: [Q, M] int (-1 padded); ring_ids: [Q] int
    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages, states_per_page] fp32
    # ring_rows: [num_rings, ring_slots, ring_row_bytes] uint8; mla: [num_blocks, block_size, H, E] uint8
    # -> [Q, K + K * 132 + (kpool - 1) * ring_row_bytes + (K * kpool + kpool - 1) * H * E] int64
    """
    states = indexer_q.shape[1] * indexer_q.shape[2]
    slots = pool_slots(block_table, pools, kpool=kpool, states=states)  # [Q, K], -1 = none or no block
    held = slots >= 0
    entry_q, entry_scale = read_entries(indexer_q, indexer_scale, slots.clamp_min(0).flatten())
    entries = torch.cat([entry_q.view(torch.uint8), entry_scale.view(torch.uint8).view(-1, 4)], dim=1)
    entries = entries.view(*pools.shape, FP8_ENTRY_BYTES) * held[..., None]
    open_pos = open_group_positions(seq_lens, kpool)  # [Q, kpool - 1]
    ring = gather_ring_rows(ring_rows, ring_ids, open_pos)
    pool_tokens = pools[..., None] * kpool + torch.arange(kpool, device=pools.device)
    attended = torch.cat([torch.where((pools >= 0)[..., None], pool_tokens, -1).flatten(1), open_pos], dim=1)
    mla_bytes = gather_mla(mla, block_table, attended)
    return torch.cat([pools + 1, entries.flatten(1).to(torch.int64), ring.flatten(1).to(torch.int64),
                      mla_bytes.flatten(1).to(torch.int64)], dim=1)


def qsa_features(chosen: torch.Tensor, token_indices: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 ring_ids: torch.Tensor, compressed: torch.Tensor, ring_rows: torch.Tensor, mla: torch.Tensor, *,
                 compress_ratio: int) -> torch.Tensor:
    """One layer's QSA features of each row (module docstring).

    # chosen: [Q, K] int64 (-1 = none); token_indices: [Q, K * r + r - 1] int64 (-1 = none); seq_lens: [Q] int
    # block_table: [Q, M] int (-1 padded); ring_ids: [Q] int; compressed: [num_blocks, block_size / r, H, D] bf16 | fp8
    # ring_rows: [num_rings, ring_slots, ring_row_bytes] uint8; mla: [num_blocks, block_size, H', E] uint8
    # -> [Q, K + K * H * D * element_bytes + (r - 1) * ring_row_bytes + (K * r + r - 1) * H' * E] int64
    """
    r, rows_per_block = compress_ratio, compressed.shape[1]
    valid = chosen >= 0
    safe = torch.where(valid, chosen, 0)
    blocks = torch.gather(block_table.to(torch.int64), 1, safe * r // (rows_per_block * r))
    held = valid & (blocks >= 0)
    picked = compressed[torch.where(held, blocks, 0), safe % rows_per_block]  # [Q, K, H, D]
    picked = picked.contiguous().view(torch.uint8).reshape(*chosen.shape, -1) * held[..., None]
    open_pos = open_group_positions(seq_lens, r)  # [Q, r - 1]
    ring = gather_ring_rows(ring_rows, ring_ids, open_pos)
    mla_bytes = gather_mla(mla, block_table, token_indices)
    return torch.cat([chosen + 1, picked.flatten(1).to(torch.int64), ring.flatten(1).to(torch.int64),
                      mla_bytes.flatten(1).to(torch.int64)], dim=1)


def kpool_layer_hash(acc: torch.Tensor, weights: torch.Tensor, pools: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, ring_ids: torch.Tensor, indexer_q: torch.Tensor,
                     indexer_scale: torch.Tensor, ring_rows: torch.Tensor, mla: torch.Tensor, *,
                     kpool: int) -> torch.Tensor:
    """# acc: [Q] int64 in [0, P); weights: [F] int64; the rest as ``kpool_features`` -> [Q] int64 in [0, P)"""
    features = kpool_features(pools, seq_lens, block_table, ring_ids, indexer_q, indexer_scale, ring_rows, mla,
                              kpool=kpool)
    return fold_layer(acc, weights, features)


def qsa_layer_hash(acc: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, token_indices: torch.Tensor,
                   seq_lens: torch.Tensor, block_table: torch.Tensor, ring_ids: torch.Tensor, compressed: torch.Tensor,
                   ring_rows: torch.Tensor, mla: torch.Tensor, *, compress_ratio: int) -> torch.Tensor:
    """# acc: [Q] int64 in [0, P); weights: [F] int64; the rest as ``qsa_features`` -> [Q] int64 in [0, P)"""
    features = qsa_features(chosen, token_indices, seq_lens, block_table, ring_ids, compressed, ring_rows, mla,
                            compress_ratio=compress_ratio)
    return fold_layer(acc, weights, features)
