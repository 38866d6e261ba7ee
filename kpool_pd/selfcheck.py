"""`kpool-pd selfcheck`: the DESIGN section 2 invariant, shown on a small multi-layer config.

For each configuration, one request's committed sequence is run two ways through the public
cache ops: a colocated prefill of the whole sequence, and a prefill of a prefix followed by
decode steps with speculative drafts (a seeded accept/reject history; rejected drafts carry
garbage keys). The digests of the final caches (every complete pool's fp8 entry, the ring's
open pool) must be equal.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from kpool_pd.kernels import kpool_decode_update, kpool_prefill, kpool_read_entries
from kpool_pd.kernels.kpool_cache import pool_slots
from kpool_pd.kvcache import CacheConfig, NodeCache, PoolMode, complete_entries

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SelfcheckCase:
    kpool: int
    num_spec: int
    prompt_len: int
    total_len: int
    mode: PoolMode = PoolMode.SOFTMAX
    layers: int = 2
    block_size: int | None = None  # None: 16 pools a block

    @property
    def block(self) -> int:
        return self.block_size or 16 * self.kpool


@dataclass(frozen=True)
class SelfcheckRow:
    case: SelfcheckCase
    steps: int
    drafts_proposed: int
    drafts_accepted: int
    colocated_digest: str
    pd_digest: str

    @property
    def holds(self) -> bool:
        return self.colocated_digest == self.pd_digest


DEFAULT_CASES = (
    SelfcheckCase(kpool=2, num_spec=0, prompt_len=33, total_len=97),
    SelfcheckCase(kpool=4, num_spec=1, prompt_len=64, total_len=200),
    SelfcheckCase(kpool=4, num_spec=3, prompt_len=1, total_len=129),
    SelfcheckCase(kpool=4, num_spec=3, prompt_len=66, total_len=257, mode=PoolMode.KEEP_LAST),
    SelfcheckCase(kpool=8, num_spec=7, prompt_len=127, total_len=300),
    SelfcheckCase(kpool=2, num_spec=3, prompt_len=100, total_len=300, block_size=256),  # two kernel pages a block
)


class _Request:
    """One request's caches in a node cache of its own (blocks allocated as the sequence grows)."""

    def __init__(self, config: CacheConfig, ape: torch.Tensor, capacity: int) -> None:
        self.config = config
        self.cache = NodeCache(config, num_blocks=config.blocks_for_tokens(capacity) + 3, num_rings=1)
        self.pool = self.cache.pool
        self._offset = self.cache.allocate("offset", 0, ring=False)  # blocks the request's ids start after
        self.skip_block()  # start the request's blocks at id 1 so its ids differ from the other run
        self._request = self.cache.allocate("request", 0)
        self.ape = ape

    def skip_block(self) -> None:
        """Move the request's next block id one further."""
        self._offset.extend(1)

    def release(self) -> None:
        self._request.release()
        self._offset.release()

    def _table(self, tokens: int) -> torch.Tensor:
        missing = self.config.blocks_for_tokens(tokens) - self._request.num_blocks
        if missing > 0:
            self._request.extend(missing)
        return torch.tensor([self._request.block_ids], dtype=torch.int32)

    @property
    def ring(self) -> int:
        return self._request.ring_id

    def prefill(self, k: torch.Tensor, gate: torch.Tensor) -> None:
        # k, gate: [layers, L, 128] bf16
        table = self._table(k.shape[1])
        for layer in range(self.config.num_layers):
            kpool_prefill(k[layer], gate[layer], self.ape[layer], torch.tensor([0, k.shape[1]]), table,
                          torch.tensor([0]), self.pool.indexer_q(layer), self.pool.indexer_scale(layer),
                          self.pool.tail_ring(layer), mode=self.config.pool_mode)

    def step(self, k: torch.Tensor, gate: torch.Tensor, start: int) -> None:
        # k, gate: [layers, 1 + drafts, 128] bf16 at positions start, start + 1, ...
        table = self._table(start + k.shape[1])
        for layer in range(self.config.num_layers):
            kpool_decode_update(k[layer], gate[layer], torch.tensor([start]), torch.tensor([0, k.shape[1]]),
                                torch.tensor([0]), table, self.ape[layer], self.pool.tail_ring(layer),
                                self.pool.indexer_q(layer), self.pool.indexer_scale(layer),
                                mode=self.config.pool_mode)

    def digest(self, length: int) -> str:
        config = self.config
        pools = torch.arange(config.complete_entries(length))[None]
        states = config.family_spec.entries_per_block
        slots = pool_slots(self._table(length), pools, kpool=config.kpool, states=states)[0]
        open_positions = torch.arange(config.open_entry_start(length), length) % config.ring_slots
        sha = hashlib.sha256()
        for layer in range(self.config.num_layers):
            q, scale = kpool_read_entries(self.pool.indexer_q(layer), self.pool.indexer_scale(layer), slots,
                                          dequantize=False)
            sha.update(q.view(torch.uint8).numpy().tobytes())
            sha.update(scale.numpy().tobytes())
            ring = self.pool.tail_ring(layer)[self.ring][:, open_positions]
            sha.update(ring.contiguous().view(torch.uint8).numpy().tobytes())
        return sha.hexdigest()


def run_case(case: SelfcheckCase, seed: int) -> SelfcheckRow:
    config = CacheConfig(layer_names=tuple(f"layer.{i}" for i in range(case.layers)), kpool=case.kpool,
                         num_spec=case.num_spec, block_size=case.block,
                         pool_mode=case.mode)
    gen = torch.Generator().manual_seed(seed)
    shape = (case.layers, case.total_len, 128)
    k = torch.randn(shape, generator=gen).to(torch.bfloat16)
    gate = torch.randn(shape, generator=gen).to(torch.bfloat16)
    ape = torch.randn(case.layers, case.kpool, 128, generator=gen)
    capacity = case.total_len + case.num_spec

    colocated, pd = _Request(config, ape, capacity), _Request(config, ape, capacity)
    try:
        colocated.prefill(k, gate)
        pd.skip_block()
        pd.prefill(k[:, :case.prompt_len], gate[:, :case.prompt_len])
        length, steps, proposed, accepted_total = case.prompt_len, 0, 0, 0
        while length < case.total_len:
            drafts = case.num_spec
            accepted = min(int(torch.randint(0, drafts + 1, (1,), generator=gen)), case.total_len - length - 1)
            step_k = torch.randn(case.layers, 1 + drafts, 128, generator=gen).to(torch.bfloat16)
            step_gate = torch.randn(case.layers, 1 + drafts, 128, generator=gen).to(torch.bfloat16)
            step_k[:, :1 + accepted] = k[:, length:length + 1 + accepted]
            step_gate[:, :1 + accepted] = gate[:, length:length + 1 + accepted]
            pd.step(step_k, step_gate, length)
            length += 1 + accepted
            steps, proposed, accepted_total = steps + 1, proposed + drafts, accepted_total + accepted
        logger.debug("case %s: %d steps", case, steps)
        return SelfcheckRow(case, steps, proposed, accepted_total, colocated.digest(length), pd.digest(length))
    finally:
        colocated.release()
        pd.release()



def format_table(rows: list[SelfcheckRow]) -> str:
    header = (f"{'kpool':>5} {'spec':>4} {'block':>5} {'mode':>9} {'prompt':>6} {'tokens':>6} {'steps':>5} "
              f"{'drafts':>11} {'pools':>5}  {'colocated digest':<16}  {'PD digest':<16}  invariant")
    lines = [header, "-" * len(header)]
    for row in rows:
        c = row.case
        lines.append(
            f"{c.kpool:>5} {c.num_spec:>4} {c.block:>5} {c.mode.value:>9} {c.prompt_len:>6} {c.total_len:>6} "
            f"{row.steps:>5} {f'{row.drafts_accepted}/{row.drafts_proposed}':>11} "
            f"{complete_entries(c.total_len, c.kpool):>5}  "
            f"{row.colocated_digest[:16]:<16}  {row.pd_digest[:16]:<16}  {'holds' if row.holds else 'BROKEN'}"
        )
    return "\n".join(lines)
