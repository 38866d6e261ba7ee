"""The QSA family through the public QSA ops: metadata, forward update, top-k, compressed rows.

Every forward's metadata comes from the family's one ``QsaMetadataBuilder`` (buffers allocated once, the
host counts from the batch's host copies); a forward larger than its buffers gets a builder of twice the
room it needs, once, as vLLM sizes its builders from the largest batch it schedules. A decode step replayed
from a CUDA graph (``kpool_pd.model.decode_graphs``) builds its metadata inside the graph, into the same
buffers: the engine ``reserve``s room for its largest bucket before it captures, and a builder outgrown
later keeps its buffers while the family lives (a graph captured over them writes them on every replay).

MRoPE: a batch's ``mrope_positions`` (time, height, width per token: an image's tokens share a time and vary
in height and width) give the compressed rows' rotary and the positions the ring stores packed
(``cache_rope_positions``); a batch without them is text, every axis the token's position.
"""

from __future__ import annotations

import logging

import torch

from kpool_pd.kernels.qsa_metadata import QsaMetadata
from kpool_pd.kernels.qsa_metadata.builder import QsaMetadataBuilder
from kpool_pd.kernels.qsa_rope import text_positions
from kpool_pd.kernels.qsa_score import qsa_topk
from kpool_pd.kernels.qsa_update import qsa_forward_update
from kpool_pd.kvcache import CachePool
from kpool_pd.model.batch import ForwardBatch
from kpool_pd.model.cache_io import LayerStacks, layer_ring_rows
from kpool_pd.model.config import ModelConfig
from kpool_pd.model.layer_hash import qsa_layer_hash
from kpool_pd.model.layer_hash.ref import qsa_features
from kpool_pd.model.rule import TokenRule
from kpool_pd.model.weights import SyntheticWeights

logger = logging.getLogger(__name__)

# the builder's first buffers: a forward of this many tokens of this many requests (vLLM's max_num_batched_tokens
# and max_num_seqs); a larger forward grows them once to twice what it needs
BUILDER_TOKENS = 8192
BUILDER_REQUESTS = 256


class QsaFamily:
    """Per forward one metadata build; per layer one forward update and one top-k launch."""

    def __init__(self, config: ModelConfig, weights: SyntheticWeights, pool: CachePool) -> None:
        self.config, self.weights, self.pool = config, weights, pool
        self.cache = pool.config
        self.keys_spec = self.cache.qsa_keys
        self.ratio = self.cache.compress_ratio
        self._metadata: tuple[ForwardBatch, QsaMetadata] | None = None
        self.builder = self._builder(BUILDER_TOKENS, BUILDER_REQUESTS)
        self._outgrown: list[QsaMetadataBuilder] = []  # their buffers may be a captured graph's
        self.stacks = LayerStacks(pool)  # every layer's views at once, for reads of a whole request

    @property
    def row_bytes(self) -> int:
        spec = self.keys_spec
        return spec.num_heads * spec.head_size * spec.element_bytes

    @property
    def feature_width(self) -> int:
        c, r = self.config, self.ratio
        attended = c.topk * r + r - 1
        return (c.topk + c.topk * self.row_bytes + (r - 1) * self.pool.layout.ring_row_bytes
                + attended * self.pool.layout.mla_page_bytes // self.cache.block_size)

    def _builder(self, tokens: int, requests: int) -> QsaMetadataBuilder:
        return QsaMetadataBuilder(compress_ratio=self.ratio, ring_capacity=self.cache.ring_slots,
                                  block_size=self.cache.block_size, num_spec=self.cache.num_spec,
                                  max_num_batched_tokens=tokens, max_num_seqs=requests, device=self.pool.device)

    def reserve(self, tokens: int, requests: int) -> None:
        """Make the builder hold forwards of ``tokens`` tokens of ``requests`` requests without growing (the engine
        calls it for its largest decode graph, before capturing any)."""
        if tokens > self.builder.max_num_batched_tokens or requests > self.builder.max_num_seqs:
            grown = (max(2 * tokens, self.builder.max_num_batched_tokens), max(2 * requests, self.builder.max_num_seqs))
            logger.debug("QSA metadata buffers grow to %d tokens and %d requests", *grown)
            self._outgrown.append(self.builder)
            self.builder = self._builder(*grown)

    def _metadata_of(self, batch: ForwardBatch) -> QsaMetadata:
        """The forward's metadata from the builder's buffers, built on the first layer's call (valid until the next
        forward's build: every layer of this forward reads it)."""
        if self._metadata is None or self._metadata[0] is not batch:
            qsl_cpu = batch.query_start_loc_cpu if batch.query_start_loc_cpu is not None else batch.query_start_loc.cpu()
            seq_cpu = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
            tokens, requests = batch.tokens.shape[0], batch.num_requests
            self.reserve(tokens, requests)
            metadata = self.builder.build(batch.query_start_loc, batch.seq_lens, batch.block_table, batch.ring_ids,
                                          query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu, num_tokens=tokens)
            self._metadata = (batch, metadata)
        return self._metadata[1]

    def _update(self, layer: int, batch: ForwardBatch) -> None:
        k, _ = self.weights.keys(layer, batch.tokens, batch.positions)
        spec = self.keys_spec
        qsa_forward_update(
            k[:, None, :].expand(-1, spec.num_heads, -1).contiguous(), self._mrope_positions(batch),
            self._metadata_of(batch), self.pool.qsa_ring(layer), self.pool.qsa_keys(layer),
            self.weights.norm_weight[layer], compress_ratio=self.ratio, block_size=self.cache.block_size,
            eps=spec.norm_eps, rotary_dim=spec.rotary_dim, theta=spec.rope_theta, section=spec.mrope_section,
            cache_rope_positions=self.cache.cache_rope_positions,
        )

    prefill = _update
    decode = _update

    @staticmethod
    def _mrope_positions(batch: ForwardBatch) -> torch.Tensor:
        """# -> [T, 3] int64: the batch's MRoPE positions, text where it has none"""
        return batch.mrope_positions if batch.mrope_positions is not None else text_positions(batch.positions)

    def select(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """Each row's top-k groups, the tokens they expand to, and what locates its bytes.

        # -> chosen: [Q, topk] int64, token_indices: [Q, topk * r + r - 1] int64 (-1 = none), seq_lens: [Q] int32,
        #    block_table: [Q, M] int32, ring_ids: [Q] int32
        """
        q, _ = self.weights.query(layer, batch.tokens[batch.rows], batch.positions[batch.rows])
        seq_lens, table = batch.row_seq_lens, batch.row_block_table
        chosen, token_indices = qsa_topk(q, self.pool.qsa_keys(layer), table, seq_lens, compress_ratio=self.ratio,
                                         block_size=self.cache.block_size, topk=self.config.topk)
        return chosen, token_indices, seq_lens, table, batch.row_ring_ids

    def layer_views(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's cache views the features read: compressed keys, ring rows, MLA entries."""
        return self.pool.qsa_keys(layer), layer_ring_rows(self.pool, layer), self.pool.mla(layer)

    def features(self, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """The selected compressed rows and their bytes, the open group's ring rows, and the MLA
        bytes of every attended token (``kpool_pd.model.layer_hash.ref``).

        # -> [Q, feature_width] int64
        """
        return qsa_features(*self.select(layer, batch), *self.layer_views(layer), compress_ratio=self.ratio)

    def chain(self, acc: torch.Tensor, layer: int, batch: ForwardBatch, rule: TokenRule) -> torch.Tensor:
        """``rule.chain(acc, layer, self.features(layer, batch))`` in two launches on CUDA (the top-k and the
        fused layer hash), without a host synchronisation.

        # acc: [Q] int64 in [0, P) -> [Q] int64 in [0, P)
        """
        return qsa_layer_hash(acc, rule.hash_weights[layer], *self.select(layer, batch), *self.layer_views(layer),
                              compress_ratio=self.ratio)

    def entries(self, table: torch.Tensor, length: int) -> torch.Tensor:
        """Every layer's compressed rows of every complete group of a request, layer by layer in group order,
        gathered at once on the pool's device.

        # table: [>= blocks of length] int64 (the request's blocks) -> [L * complete groups * row bytes] uint8
        """
        groups = torch.arange(self.cache.complete_entries(length), device=self.pool.device)
        blocks = table[groups * self.ratio // self.cache.block_size]
        rows = self.stacks.qsa_keys[:, blocks, groups % self.keys_spec.rows_per_block]  # [L, G, H, D]
        return rows.contiguous().view(torch.uint8).reshape(-1)
