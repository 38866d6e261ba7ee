"""The kpool indexer family through the public kpool ops: cache updates, selection, entries."""

from __future__ import annotations

import torch

from kpool_pd.kernels import kpool_decode_update, kpool_indexer_topk, kpool_prefill
from kpool_pd.kernels.kpool_cache import pool_slots
from kpool_pd.kernels.kpool_metadata import KpoolMetadata, build_kpool_metadata
from kpool_pd.kvcache import FP8_ENTRY_BYTES, CachePool
from kpool_pd.model.batch import ForwardBatch
from kpool_pd.model.cache_io import LayerStacks, layer_ring_rows
from kpool_pd.model.config import ModelConfig
from kpool_pd.model.layer_hash import kpool_layer_hash
from kpool_pd.model.layer_hash.ref import kpool_features
from kpool_pd.model.rule import TokenRule
from kpool_pd.model.weights import LayerInputs, SyntheticWeights


class KpoolFamily:
    """Per layer: one prefill or decode-update launch for the whole batch, and one top-k launch
    for every query row of the batch."""

    def __init__(self, config: ModelConfig, weights: SyntheticWeights, pool: CachePool) -> None:
        self.config, self.weights, self.pool = config, weights, pool
        self.cache = pool.config
        self.kpool = self.cache.kpool
        self.states = self.cache.family_spec.entries_per_block
        self.stacks = LayerStacks(pool)  # every layer's views at once, for reads of a whole request
        self._metadata: tuple[ForwardBatch, KpoolMetadata] | None = None

    @property
    def feature_width(self) -> int:
        topk, kpool = self.config.topk, self.kpool
        attended = topk * kpool + kpool - 1
        return (topk + topk * FP8_ENTRY_BYTES + (kpool - 1) * self.pool.layout.ring_row_bytes
                + attended * self.pool.layout.mla_page_bytes // self.cache.block_size)

    def prefill(self, layer: int, batch: ForwardBatch, inputs: LayerInputs | None = None) -> None:
        """The layer's prefill of the batch's chunks (``inputs``: the layer's keys, computed with other layers')."""
        k, gate = self._keys(layer, batch, inputs)
        kpool_prefill(k, gate, self.weights.ape[layer], batch.query_start_loc, batch.block_table, batch.ring_ids,
                      self.pool.indexer_q(layer), self.pool.indexer_scale(layer), self.pool.tail_ring(layer),
                      mode=self.cache.pool_mode, round_scale=self.cache.round_scale,
                      start_pos=None if batch.from_zero else batch.start_pos, pool_offsets=batch.pool_offsets(self.kpool))

    def _keys(self, layer: int, batch: ForwardBatch, inputs: LayerInputs | None) -> tuple[torch.Tensor, torch.Tensor]:
        """# -> k, gate: [T, 128] bf16"""
        if inputs is None:
            return self.weights.keys(layer, batch.tokens, batch.positions)
        return inputs.keys, inputs.gates

    def metadata(self, batch: ForwardBatch) -> KpoolMetadata:
        """The step's pool-granular metadata (slot mapping, complete pools, kernel pages), built on the first
        layer's call and read by every layer's op; on CUDA without a host synchronisation (a graph captures it)."""
        if self._metadata is None or self._metadata[0] is not batch:
            indexer = self.cache.kpool_indexer
            built = build_kpool_metadata(batch.query_start_loc, batch.start_pos, batch.seq_lens, batch.block_table,
                                         kpool=self.kpool, block_size=self.cache.block_size,
                                         pages_per_block=indexer.pages_per_block, num_tokens=batch.tokens.shape[0])
            self._metadata = (batch, built)
        return self._metadata[1]

    def decode(self, layer: int, batch: ForwardBatch, inputs: LayerInputs | None = None) -> None:
        """The layer's decode update (``inputs``: the layer's keys, computed with other layers'), its pools'
        slots from the step's ``metadata``."""
        k, gate = self._keys(layer, batch, inputs)
        kpool_decode_update(k, gate, batch.start_pos, batch.query_start_loc, batch.ring_ids, batch.block_table,
                            self.weights.ape[layer], self.pool.tail_ring(layer), self.pool.indexer_q(layer),
                            self.pool.indexer_scale(layer), mode=self.cache.pool_mode,
                            round_scale=self.cache.round_scale, metadata=self.metadata(batch))

    def _slots(self, block_table: torch.Tensor, pools: torch.Tensor) -> torch.Tensor:
        """Indexer slots of pools to read; pool -1 reads slot 0 (its bytes are masked out later).

        # block_table: [Q, M] int32; pools: [Q, N] int64 (-1 = none) -> [Q, N] int64
        """
        slots = pool_slots(block_table, pools, kpool=self.kpool, states=self.states)
        return torch.where(pools >= 0, slots, 0)

    def select(self, layer: int, batch: ForwardBatch, inputs: LayerInputs | None = None) -> tuple[torch.Tensor, ...]:
        """Each row's top-k pools and what locates its bytes (``inputs``: the layer's queries of the rows).

        # -> pools: [Q, topk] int64 (-1 = none), seq_lens: [Q] int32, block_table: [Q, M] int32, ring_ids: [Q] int32
        """
        if inputs is None:
            q, weights = self.weights.query(layer, batch.tokens[batch.rows], batch.positions[batch.rows])
        else:
            q, weights = inputs.queries, inputs.head_weights
        seq_lens, table = batch.row_seq_lens, batch.row_block_table
        pools, _ = kpool_indexer_topk(q, weights, seq_lens, table, self.pool.indexer_q(layer),
                                      self.pool.indexer_scale(layer), kpool=self.kpool, topk=self.config.topk)
        return pools, seq_lens, table, batch.row_ring_ids

    def layer_views(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's cache views the features read: indexer codes and scales, ring rows, MLA entries."""
        return (self.pool.indexer_q(layer), self.pool.indexer_scale(layer), layer_ring_rows(self.pool, layer),
                self.pool.mla(layer))

    def features(self, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """What the next token of each row reads: the selected pools, their fp8 entries, the open
        pool's raw K and gate, and the MLA bytes of every attended token (``kpool_pd.model.layer_hash.ref``).

        # -> [Q, feature_width] int64
        """
        return kpool_features(*self.select(layer, batch), *self.layer_views(layer), kpool=self.kpool)

    def chain(self, acc: torch.Tensor, layer: int, batch: ForwardBatch, rule: TokenRule,
              inputs: LayerInputs | None = None) -> torch.Tensor:
        """``rule.chain(acc, layer, self.features(layer, batch))`` in two launches on CUDA (the top-k and the
        fused layer hash), without a host synchronisation.

        # acc: [Q] int64 in [0, P) -> [Q] int64 in [0, P)
        """
        return kpool_layer_hash(acc, rule.hash_weights[layer], *self.select(layer, batch, inputs), *self.layer_views(layer),
                                kpool=self.kpool)

    def entries(self, table: torch.Tensor, length: int) -> torch.Tensor:
        """Every layer's fp8 entries (q bytes, then scale) of every complete pool of a request, layer by layer in
        pool order, gathered at once on the pool's device.

        # table: [>= blocks of length] int64 (the request's blocks) -> [L * complete pools * (128 + 4)] uint8
        """
        return self.entry_rows(table, self.cache.complete_entries(length)).reshape(-1)

    def entry_rows(self, table: torch.Tensor, count: int) -> torch.Tensor:
        """Every layer's fp8 entries of the first ``count`` pools the block table holds (a DCP rank: its own, in local
        order), gathered at once on the pool's device.

        # table: [>= blocks of count pools] int64 -> [L, count, 128 + 4] uint8
        """
        pools = torch.arange(count, device=self.pool.device)
        slots = self._slots(table[None], pools[None])[0]  # [count]
        block, state = slots // self.states, slots % self.states
        per_page = self.cache.family_spec.states_per_page
        where = (block, state // per_page, state % per_page)
        q = self.stacks.indexer_q[(slice(None), *where)]  # [L, count, 128]
        scale = self.stacks.indexer_scale[(slice(None), *where)]  # [L, count]
        scale = scale.contiguous().view(torch.uint8).view(*scale.shape, 4)
        return torch.cat([q.view(torch.uint8), scale], dim=2)
