"""The kpool indexer family on one DCP decode rank (DESIGN section 2, "Decode-context parallel").

The rank's cache holds its own tokens' MLA bytes and its own pools' entries at local positions
(``kpool_pd.kvcache.dcp``), and the request's whole tail ring. A batch's block tables are the rank's
local block tables; positions, sequence lengths and pools are global.

- Decode update: every token of the step is stashed in the rank's ring (one decode-update launch
  with no block to write), then each pool the step completes that this rank owns is compressed
  from the ring and written at its local slot (one compress and one write launch).
- Features: each rank scores its own complete pools; ``join_topk`` (one collective) gives the
  global top-k. The rank then fills the features that it holds (the entries of its selected pools,
  the MLA bytes of its attended tokens; rank 0 also the selection and the open pool's ring rows)
  and leaves the rest zero: the model's hash is linear, so the ranks' partial hashes add up (modulo
  its prime) to the hash of the whole features.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels import (
    kpool_compress,
    kpool_decode_update,
    kpool_indexer_topk,
    kpool_read_entries,
    kpool_write_entries,
)
from kpool_pd.kernels.kpool_cache import pool_slots
from kpool_pd.kvcache import FP8_ENTRY_BYTES, CachePool, DcpShard
from kpool_pd.model.batch import ForwardBatch
from kpool_pd.model.cache_io import open_positions, read_mla, read_ring_rows, write_mla
from kpool_pd.model.config import ModelConfig
from kpool_pd.model.dcp_group import DcpGroup
from kpool_pd.model.dcp_topk import join_topk
from kpool_pd.model.kpool_family import KpoolFamily
from kpool_pd.model.rule import TokenRule
from kpool_pd.model.weights import SyntheticWeights


class DcpKpoolFamily(KpoolFamily):
    """Per layer: the ring stash, the owned pools' compress and write, a top-k over the rank's own
    pools and one all-gather joining the ranks' top-k."""

    def __init__(self, config: ModelConfig, weights: SyntheticWeights, pool: CachePool, group: DcpGroup) -> None:
        super().__init__(config, weights, pool)
        self.group = group
        self.shard: DcpShard = group.shard

    def prefill(self, layer: int, batch: ForwardBatch) -> None:
        raise ValueError("a DCP decode rank takes a request's prompt by transfer from a prefill node, not by prefill")

    # updates --------------------------------------------------------------------------
    def decode(self, layer: int, batch: ForwardBatch) -> None:
        k, gate = self.weights.keys(layer, batch.tokens, batch.positions)
        ring, index_q, index_scale = self.pool.tail_ring(layer), self.pool.indexer_q(layer), self.pool.indexer_scale(layer)
        no_blocks = torch.full((batch.num_requests, 1), -1, dtype=torch.int32, device=k.device)
        kpool_decode_update(k, gate, batch.start_pos, batch.query_start_loc, batch.ring_ids, no_blocks,
                            self.weights.ape[layer], ring, index_q, index_scale, mode=self.cache.pool_mode,
                            round_scale=self.cache.round_scale)
        positions, request = batch.positions, batch.token_request
        completes = (positions % self.kpool == self.kpool - 1) & self.shard.owns(positions)
        if not bool(completes.any()):
            return
        last, request = positions[completes], request[completes]  # [P]: each completed pool's last position
        window = last[:, None] - self.kpool + 1 + torch.arange(self.kpool, device=k.device)  # [P, kpool]
        ring_ids = batch.ring_ids.to(torch.int64)[request]
        slots = window % self.cache.ring_slots
        pool_k, pool_gate = ring[ring_ids[:, None], 0, slots], ring[ring_ids[:, None], 1, slots]  # [P, kpool, 128]
        q, scale = kpool_compress(pool_k.contiguous(), pool_gate.contiguous(), self.weights.ape[layer],
                                  mode=self.cache.pool_mode, round_scale=self.cache.round_scale)
        local_pools = self.shard.local_position(last - self.kpool + 1) // self.kpool
        entry_slots = pool_slots(batch.block_table[request], local_pools[:, None], kpool=self.kpool,
                                 states=self.states)[:, 0]
        kpool_write_entries(index_q, index_scale, q, scale, entry_slots)

    def write_mla(self, layer: int, batch: ForwardBatch) -> None:
        """Store the MLA entries of the batch's tokens that this rank owns, at their local positions."""
        mine = self.shard.owns(batch.positions)
        positions, tokens = batch.positions[mine], batch.tokens[mine]
        if positions.numel() == 0:
            return
        write_mla(self.pool, layer, batch.block_table, batch.token_request[mine],
                  self.shard.local_position(positions), self.weights.mla_bytes(layer, tokens, positions))

    # selection ------------------------------------------------------------------------
    def local_pools(self, pools: torch.Tensor) -> torch.Tensor:
        """Local pool indices of this rank's pools, -1 for every other (and for none).

        # pools: [Q, N] int64 global (-1 = none) -> [Q, N] int64
        """
        mine = (pools >= 0) & self.shard.owns(pools * self.kpool)
        return torch.where(mine, self.shard.local_position(torch.where(mine, pools, 0) * self.kpool) // self.kpool, -1)

    def features(self, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """This rank's part of each row's features (zero where another rank holds the bytes).

        # -> [Q, feature_width] int64
        """
        rows, kpool = batch.rows, self.kpool
        q, weights = self.weights.query(layer, batch.tokens[rows], batch.positions[rows])
        seq_lens, table = batch.row_seq_lens, batch.row_block_table
        own_lens = self.shard.owned_tokens(seq_lens.to(torch.int64) // kpool * kpool).to(torch.int32)
        local, scores = kpool_indexer_topk(q, weights, own_lens, table, self.pool.indexer_q(layer),
                                           self.pool.indexer_scale(layer), kpool=kpool, topk=self.config.topk)
        mine = torch.where(local >= 0, self.shard.global_position(local * kpool) // kpool, -1)
        pools = join_topk(self.group, mine, scores, self.config.topk)  # [Q, topk] global
        valid = pools >= 0
        local = self.local_pools(pools)
        held = local >= 0
        entry_q, entry_scale = kpool_read_entries(self.pool.indexer_q(layer), self.pool.indexer_scale(layer),
                                                  self._slots(table, local).flatten(), dequantize=False)
        entries = torch.cat([entry_q.view(torch.uint8), entry_scale.view(torch.uint8).view(-1, 4)], dim=1)
        entries = entries.view(*pools.shape, FP8_ENTRY_BYTES) * held[..., None]
        open_pos = open_positions(self.cache, seq_lens)  # [Q, kpool - 1]
        ring = read_ring_rows(self.pool, layer, batch.row_ring_ids, open_pos)
        pool_tokens = pools[..., None] * kpool + torch.arange(kpool, device=pools.device)
        attended = torch.cat([torch.where(valid[..., None], pool_tokens, -1).flatten(1), open_pos], dim=1)
        owned = (attended >= 0) & self.shard.owns(attended)
        mla = read_mla(self.pool, layer, table, torch.where(owned, self.shard.local_position(attended), -1))
        head = pools + 1
        if self.shard.rank != 0:  # the selection and the ring are known to every rank: rank 0 counts them
            head, ring = torch.zeros_like(head), torch.zeros_like(ring)
        return torch.cat([head, entries.flatten(1).to(torch.int64), ring.flatten(1).to(torch.int64),
                          mla.flatten(1).to(torch.int64)], dim=1)

    def chain(self, acc: torch.Tensor, layer: int, batch: ForwardBatch, rule: TokenRule) -> torch.Tensor:
        """This rank's part of the layer's hash, from ``features`` (the fused hash reads one rank's whole selection).

        # acc: [Q] int64 in [0, P) -> [Q] int64 in [0, P)
        """
        return rule.chain(acc, layer, self.features(layer, batch))
