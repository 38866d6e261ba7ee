"""The synthetic model's configuration: its cache's (the family and its parameters, the layers), and the seed.

Both daemons and the colocated runner build their caches from one ``ModelConfig``, so the two
sides of a transfer agree on every byte (the connector's layout hash checks it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kpool_pd.kvcache import (
    DEFAULT_KERNEL_PAGE_STATES, DEFAULT_MLA_ENTRY_BYTES, BlockOrder, CacheConfig, CacheDtype, CacheFamily, PoolMode,
    family_spec_type,
)

DEFAULT_BLOCK_SIZE = 256  # tokens: the model-wide attention block
BLOCK_SIZE_QUANTUM = 128  # the attention block is a multiple of 128 tokens


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def default_block_size(family: CacheFamily, kpool: int, compress_ratio: int, num_spec: int) -> int:
    """256 tokens, or where the ring or the group (kpool, QSA ratio) does not divide 256, the smallest
    multiple of 128 that they divide: lcm(128, group, ring slots). kpool 4, 3 drafts: 256; kpool 3,
    no drafts (ring 3): 384; QSA ratio 4, 5 drafts (ring 12): 384."""
    spec = family_spec_type(family)
    group = spec.tokens_per_entry_for(kpool=kpool, compress_ratio=compress_ratio)
    ring = spec.ring_slots_for(group, num_spec)
    if DEFAULT_BLOCK_SIZE % group == 0 and DEFAULT_BLOCK_SIZE % ring == 0:
        return DEFAULT_BLOCK_SIZE
    return math.lcm(BLOCK_SIZE_QUANTUM, group, ring)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Everything that decides the model's bytes and tokens: its cache (``cache``: the family and its
    parameters, the layers, the block size) and what is the model's own (the seed, the vocabulary, the
    indexer's query heads, the top-k).

    ``build`` makes one from the common parameters (the cache's layers named ``layer.0`` on, the block
    size picked by ``default_block_size`` unless given). ``topk`` pools (QSA: groups) are selected per
    query; ``index_heads`` is the indexer's query head count.
    """

    cache: CacheConfig
    seed: int = 0
    vocab_size: int = 1024
    index_heads: int = 4
    topk: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise ValueError(f"cache must be a CacheConfig, got {type(self.cache).__name__}")
        _positive(vocab_size=self.vocab_size, index_heads=self.index_heads, topk=self.topk)
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.vocab_size < 2 or self.vocab_size > 1 << 20:
            raise ValueError(f"vocab_size must be in [2, 2**20], got {self.vocab_size}")

    @classmethod
    def build(cls, *, family: CacheFamily = CacheFamily.KPOOL, num_layers: int = 2, kpool: int = 4,
              compress_ratio: int = 4, num_spec: int = 0, block_size: int | None = None,
              mla_entry_bytes: int = DEFAULT_MLA_ENTRY_BYTES, pool_mode: PoolMode = PoolMode.SOFTMAX,
              qsa_dtype: CacheDtype = CacheDtype.BFLOAT16, kernel_page_states: int = DEFAULT_KERNEL_PAGE_STATES,
              round_scale: bool = True, block_order: BlockOrder = BlockOrder.BLNHC, cache_rope_positions: bool = False,
              seed: int = 0, vocab_size: int = 1024, index_heads: int = 4, topk: int = 8) -> ModelConfig:
        """The model of ``num_layers`` layers (``layer.0`` on) over a cache of these parameters; ``block_size``
        None picks ``default_block_size``. ValueError naming the value for one the cache or the model refuses."""
        if not isinstance(family, CacheFamily):
            raise ValueError(f"family must be a CacheFamily, got {family!r}")
        _positive(num_layers=num_layers, kpool=kpool, compress_ratio=compress_ratio)
        if not isinstance(num_spec, int) or isinstance(num_spec, bool) or num_spec < 0:
            raise ValueError(f"num_spec must be an integer >= 0, got {num_spec!r}")
        if block_size is None:
            block_size = default_block_size(family, kpool, compress_ratio, num_spec)
        cache = CacheConfig(
            family=family, layer_names=tuple(f"layer.{i}" for i in range(num_layers)), block_size=block_size,
            num_spec=num_spec, mla_entry_bytes=mla_entry_bytes, kpool=kpool, pool_mode=pool_mode,
            compress_ratio=compress_ratio, qsa_dtype=qsa_dtype, kernel_page_states=kernel_page_states,
            round_scale=round_scale, order=block_order, cache_rope_positions=cache_rope_positions,
        )
        return cls(cache=cache, seed=seed, vocab_size=vocab_size, index_heads=index_heads, topk=topk)

    @property
    def num_layers(self) -> int:
        return self.cache.num_layers

    def describe(self) -> dict[str, object]:
        cache = self.cache
        return {
            "family": cache.family.value, "layers": cache.num_layers, "kpool": cache.kpool,
            "compress_ratio": cache.compress_ratio, "num_spec": cache.num_spec,
            "block_size": cache.block_size, "seed": self.seed, "vocab_size": self.vocab_size,
            "index_heads": self.index_heads, "topk": self.topk, "mla_entry_bytes": cache.mla_entry_bytes,
            "kernel_page_states": cache.kernel_page_states, "block_order": cache.order.value,
            "round_scale": cache.round_scale, "cache_rope_positions": cache.cache_rope_positions,
        }

    def identity(self) -> str:
        """The model's identity for a handshake: canonical JSON (sorted keys, no spaces) of every
        field that changes tokens or what the cache's bytes mean (``describe()`` plus the pool mode
        and the QSA dtype, less the block size, the block order and the kernel page, which only arrange the bytes:
        prefill and decode may differ in them, see ``kpool_pd.connector.shared.compat``). Two nodes may exchange
        caches only when their identities are equal."""
        fields = {**self.describe(), "pool_mode": self.cache.pool_mode.value, "qsa_dtype": self.cache.qsa_dtype.value}
        for arranging in ("block_size", "kernel_page_states", "block_order"):
            del fields[arranging]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))
