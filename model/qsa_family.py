"""The QSA family through the public QSA ops: metadata, forward update, top-k, compressed rows.

Text tokens only: every MRoPE position is (pos, pos, pos); the ring still stores it packed, as
a multimodal request would need.
"""

from __future__ import annotations

import torch

from kernels.qsa_metadata import QsaMetadata, build_qsa_metadata
from kernels.qsa_rope import text_positions
from kernels.qsa_score import qsa_topk
from kernels.qsa_update import qsa_forward_update
from kvcache import CachePool
from model.batch import ForwardBatch
from model.cache_io import open_positions, read_mla, read_ring_rows
from model.config import ModelConfig
from model.weights import SyntheticWeights


class QsaFamily:
    """Per forward one metadata build; per layer one forward update and one top-k launch."""

    def __init__(self, config: ModelConfig, weights: SyntheticWeights, pool: CachePool) -> None:
        self.config, self.weights, self.pool = config, weights, pool
        self.cache = pool.config
        self.keys_spec = self.cache.qsa_keys
        self.ratio = self.cache.compress_ratio
        self._metadata: tuple[ForwardBatch, QsaMetadata] | None = None

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

    def _metadata_of(self, batch: ForwardBatch) -> QsaMetadata:
        if self._metadata is None or self._metadata[0] is not batch:
            metadata = build_qsa_metadata(batch.query_start_loc, batch.seq_lens, batch.block_table, batch.ring_ids,
                                          compress_ratio=self.ratio, ring_capacity=self.cache.ring_slots,
                                          block_size=self.cache.block_size)
            self._metadata = (batch, metadata)
        return self._metadata[1]

    def _update(self, layer: int, batch: ForwardBatch) -> None:
        k, _ = self.weights.keys(layer, batch.tokens, batch.positions)
        spec = self.keys_spec
        qsa_forward_update(
            k[:, None, :].expand(-1, spec.num_heads, -1).contiguous(), text_positions(batch.positions),
            self._metadata_of(batch), self.pool.qsa_ring(layer), self.pool.qsa_keys(layer),
            self.weights.norm_weight[layer], compress_ratio=self.ratio, block_size=self.cache.block_size,
            eps=spec.norm_eps, rotary_dim=spec.rotary_dim, theta=spec.rope_theta, section=spec.mrope_section,
            cache_rope_positions=self.cache.cache_rope_positions,
        )

    prefill = _update
    decode = _update

    def features(self, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """The selected compressed rows and their bytes, the open group's ring rows, and the MLA
        bytes of every attended token.

        # -> [Q, feature_width] int64
        """
        rows = batch.rows
        q, _ = self.weights.query(layer, batch.tokens[rows], batch.positions[rows])
        seq_lens, table = batch.row_seq_lens, batch.row_block_table
        compressed = self.pool.qsa_keys(layer)
        chosen, token_indices = qsa_topk(q, compressed, table, seq_lens, compress_ratio=self.ratio,
                                         block_size=self.cache.block_size, topk=self.config.topk)
        valid = chosen >= 0
        safe = torch.where(valid, chosen, 0)
        blocks = torch.gather(table.to(torch.int64), 1, safe * self.ratio // self.cache.block_size)
        rows_per_block = self.keys_spec.rows_per_block
        picked = compressed[torch.where(valid, blocks, 0), safe % rows_per_block]  # [Q, topk, H, D]
        picked = picked.contiguous().view(torch.uint8).reshape(*chosen.shape, -1) * valid[..., None]
        open_pos = open_positions(self.cache, seq_lens)  # [Q, r - 1]
        ring = read_ring_rows(self.pool, layer, batch.ring_ids[batch.row_request], open_pos)
        mla = read_mla(self.pool, layer, table, token_indices)
        return torch.cat([(chosen + 1), picked.flatten(1).to(torch.int64), ring.flatten(1).to(torch.int64),
                          mla.flatten(1).to(torch.int64)], dim=1)

    def entries(self, layer: int, block_ids: list[int], length: int) -> bytes:
        """The compressed rows of every complete group in group order."""
        groups = torch.arange(self.cache.complete_entries(length), device=self.pool.device)
        table = torch.tensor(block_ids, dtype=torch.int64, device=self.pool.device)
        blocks = table[groups * self.ratio // self.cache.block_size]
        rows = self.pool.qsa_keys(layer)[blocks, groups % self.keys_spec.rows_per_block]
        return rows.contiguous().view(torch.uint8).cpu().numpy().tobytes()
