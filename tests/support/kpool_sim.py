"""Test driver for one request's kpool caches: prefill, decode steps with drafts, snapshots.

It calls only the public ops, so the invariant tests exercise exactly what the workers call.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels import kpool_decode_update, kpool_prefill, kpool_read_entries
from kpool_pd.kvcache import BlockLayout, CacheConfig, CachePool

D = 128


def random_ape(kpool: int, generator: torch.Generator) -> torch.Tensor:
    """# -> [kpool, 128] fp32"""
    return torch.randn(kpool, D, generator=generator)


def random_keys(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """# -> k, gate: [count, 128] bf16"""
    k = torch.randn(count, D, generator=generator).to(torch.bfloat16)
    gate = (2 * torch.randn(count, D, generator=generator)).to(torch.bfloat16)
    return k, gate


class RequestCache:
    """One request in a freshly poisoned pool, with non-contiguous block ids."""

    def __init__(self, config: CacheConfig, max_tokens: int, ape: torch.Tensor, generator: torch.Generator) -> None:
        self.config = config
        self.layout = BlockLayout(config)
        blocks = config.blocks_for_tokens(max_tokens)
        self.pool = CachePool(self.layout, num_blocks=3 * blocks + 1, num_rings=3)
        self.pool.blocks.random_(0, 256, generator=generator)  # poison: unwritten bytes never match
        self.pool.rings.random_(0, 256, generator=generator)
        shuffled = torch.randperm(self.pool.num_blocks, generator=generator)[:blocks]  # ids no allocator hands out
        self.block_ids = [int(b) for b in shuffled]
        self.block_table = torch.tensor([self.block_ids], dtype=torch.int32)
        self.ring_id = int(torch.randint(0, 3, (1,), generator=generator))
        self.ape = ape

    def views(self, layer: int = 0):
        return self.pool.tail_ring(layer), self.pool.indexer_q(layer), self.pool.indexer_scale(layer)

    def prefill(self, k: torch.Tensor, gate: torch.Tensor) -> None:
        ring, iq, iscale = self.views()
        qsl = torch.tensor([0, k.shape[0]], dtype=torch.int32)
        kpool_prefill(k, gate, self.ape, qsl, self.block_table, torch.tensor([self.ring_id]), iq, iscale, ring,
                      mode=self.config.pool_mode, round_scale=self.config.round_scale)

    def step(self, k: torch.Tensor, gate: torch.Tensor, start: int) -> None:
        ring, iq, iscale = self.views()
        kpool_decode_update(
            k, gate, torch.tensor([start]), torch.tensor([0, k.shape[0]], dtype=torch.int32),
            torch.tensor([self.ring_id]), self.block_table, self.ape, ring, iq, iscale,
            mode=self.config.pool_mode, round_scale=self.config.round_scale,
        )

    def snapshot(self, length: int) -> tuple[bytes, bytes, bytes]:
        """(q bytes, scale bytes) of every complete pool in pool order, and the ring's open pool
        (K then gate of each open position, in position order)."""
        kpool, states = self.config.kpool, self.config.block_size // self.config.kpool
        pools = torch.arange(length // kpool)
        slots = self.block_table[0, (pools * kpool) // self.config.block_size].to(torch.int64) * states + pools % states
        q, scale = kpool_read_entries(*self.views()[1:], slots, dequantize=False)
        ring = self.views()[0]
        positions = torch.arange(length // kpool * kpool, length) % ring.shape[2]
        open_pool = torch.cat([ring[self.ring_id, 0, positions], ring[self.ring_id, 1, positions]])
        return q.view(torch.uint8).numpy().tobytes(), scale.numpy().tobytes(), open_pool.view(torch.int16).numpy().tobytes()


def decode_history(cache: RequestCache, k: torch.Tensor, gate: torch.Tensor, prompt_len: int,
                   accepts: list[int], num_spec: int, generator: torch.Generator) -> int:
    """Prefill ``prompt_len`` tokens, then one step per entry of ``accepts`` (drafts accepted in
    that step; the first rejected draft and every later one carry garbage keys). Returns the
    committed length. ``k, gate`` hold the committed sequence's keys."""
    total = k.shape[0]
    cache.prefill(k[:prompt_len], gate[:prompt_len])
    length = prompt_len
    for accepted in accepts:
        if length >= total:
            break
        drafts = num_spec
        accepted = min(accepted, drafts, total - length - 1)
        step_k, step_gate = random_keys(1 + drafts, generator)  # garbage for rejected drafts
        step_k[: 1 + accepted] = k[length:length + 1 + accepted]
        step_gate[: 1 + accepted] = gate[length:length + 1 + accepted]
        cache.step(step_k, step_gate, length)
        length += 1 + accepted
    return length
