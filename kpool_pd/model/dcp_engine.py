"""The engine of one DCP decode rank: decode steps over the rank's own pools, in step with the others.

Every rank of a DCP decode instance runs ``decode_step`` on the same sequences (same request
order, same committed lengths, each with its own local block table and ring), at the same time:
per layer one all-gather joins the ranks' top-k, and per step one all-reduce adds up the ranks'
partial hashes. Every rank then derives the same tokens and the same draft verdicts, so the
ranks' sequences stay equal without any other exchange. The outputs and the state digest are
those of a single rank holding everything (``model.Engine``), whatever the rank count.

A DCP rank runs no prefill: a request's prompt arrives by transfer (``land_request`` below, or
the connector's per-rank plans) from a prefill node that is not DCP.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kpool_pd.kvcache import FP8_ENTRY_BYTES, CachePool, DcpConfig, DcpShard
from kpool_pd.model.batch import ForwardBatch
from kpool_pd.model.cache_io import request_mla_rows, request_ring_rows
from kpool_pd.model.config import ModelConfig
from kpool_pd.model.dcp_group import DcpGroup
from kpool_pd.model.dcp_kpool import DcpKpoolFamily
from kpool_pd.model.engine import Engine, PrefillJob, _on_pool_device
from kpool_pd.model.rule import HASH_PRIME
from kpool_pd.model.weights import SyntheticWeights


class DcpEngine(Engine):
    """``Engine`` for rank ``group.rank`` of ``group.size``. ValueError for a cache family that
    declares no DCP support (QSA) when the group has more than one rank."""

    def __init__(self, config: ModelConfig, pool: CachePool, group: DcpGroup,
                 weights: SyntheticWeights | None = None) -> None:
        DcpConfig.for_cache(config.cache, size=group.size, interleave=group.shard.interleave)
        super().__init__(config, pool, weights)
        self.group = group
        self.shard: DcpShard = group.shard
        self.family = DcpKpoolFamily(config, self.weights, pool, group)
        self.hoists = False  # the DCP family's layers take no inputs computed for many layers at once

    def prefill(self, jobs: Sequence[PrefillJob]) -> list[int]:
        raise ValueError("a DCP decode rank takes a request's prompt by transfer from a prefill node, not by prefill")

    def _write(self, batch: ForwardBatch, update) -> None:
        for layer in range(self.config.num_layers):
            update(layer, batch)
            self.family.write_mla(layer, batch)

    def _blocks_needed(self, tokens: int) -> int:
        return self.pool.config.blocks_for_tokens(self.shard.owned_tokens(tokens))

    def _combine(self, acc: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_sum(acc) % HASH_PRIME

    # state ------------------------------------------------------------------------------
    def _owned_sizes(self, shard: DcpShard, length: int) -> tuple[int, int]:
        """(complete pools, tokens) of positions [0, length) that ``shard`` holds."""
        kpool = self.config.cache.kpool
        pools = shard.owned_tokens(self.pool.config.complete_entries(length) * kpool) // kpool
        return pools, shard.owned_tokens(length)

    def _own_state(self, block_ids: Sequence[int], length: int) -> torch.Tensor:
        """This rank's entries (layer by layer, local pool order), then its MLA bytes (layer by layer,
        local position order), as one byte row on the pool's device. # -> [n] uint8"""
        pools, tokens = self._owned_sizes(self.shard, length)
        table = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        return torch.cat([self.family.entry_rows(table, pools).reshape(-1),
                          request_mla_rows(self.family.stacks, table, tokens).reshape(-1)])

    @_on_pool_device
    def state_digest(self, block_ids: Sequence[int], ring_id: int, length: int) -> str | None:
        """The state digest of ``model.Engine.state_digest`` over the whole request, on rank 0 (None on
        the others): a collective; rank 0 gathers every rank's entries and MLA bytes and puts them
        in global order."""
        layers, kpool, entry = self.config.num_layers, self.config.cache.kpool, self.pool.layout.mla_page_bytes
        entry //= self.config.cache.block_size
        shards = DcpConfig(size=self.shard.size, interleave=self.shard.interleave).shards()
        sizes = [self._owned_sizes(s, length) for s in shards]
        widths = [layers * (pools * FP8_ENTRY_BYTES + tokens * entry) for pools, tokens in sizes]
        mine = self._own_state(block_ids, length)
        assert mine.numel() == widths[self.shard.rank], (mine.numel(), widths)
        gathered = self.group.gather_to_first(torch.nn.functional.pad(mine, (0, max(widths) - mine.numel())))
        if gathered is None:
            return None
        complete = self.pool.config.complete_entries(length)
        entries = torch.zeros(layers, complete, FP8_ENTRY_BYTES, dtype=torch.uint8)
        mla = torch.zeros(layers, length, entry, dtype=torch.uint8)
        for shard, (pools, tokens), part in zip(shards, sizes, gathered):
            part = part.cpu()
            split = layers * pools * FP8_ENTRY_BYTES
            where = shard.global_position(torch.arange(pools) * kpool) // kpool
            entries[:, where] = part[:split].view(layers, pools, FP8_ENTRY_BYTES)
            mla[:, shard.global_position(torch.arange(tokens))] = part[split:split + layers * tokens * entry].view(
                layers, tokens, entry)
        sha = hashlib.sha256(entries.numpy())  # each of these three is layer by layer
        sha.update(request_ring_rows(self.family.stacks, ring_id, length).cpu().numpy())
        sha.update(mla.numpy())
        return sha.hexdigest()
