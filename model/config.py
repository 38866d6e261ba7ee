"""The synthetic model's configuration: the cache family and its parameters, the layers, the seed.

Both daemons and the colocated runner build their caches from one ``ModelConfig``, so the two
sides of a transfer agree on every byte (the connector's layout hash checks it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kvcache import (
    DEFAULT_KERNEL_PAGE_STATES, CacheConfig, CacheDtype, CacheFamily, PoolMode, family_spec_type,
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
    """Everything that decides the model's bytes and tokens.

    ``block_size = None`` picks ``default_block_size``. ``topk`` pools (QSA: groups) are
    selected per query; ``index_heads`` is the indexer's query head count. ``kernel_page_states``
    is the kpool indexer's kernel page (32 or 64 states, ``CacheConfig``).
    """

    family: CacheFamily = CacheFamily.KPOOL
    num_layers: int = 2
    kpool: int = 4
    compress_ratio: int = 4
    num_spec: int = 0
    block_size: int | None = None
    seed: int = 0
    vocab_size: int = 1024
    index_heads: int = 4
    topk: int = 8
    mla_entry_bytes: int = 656
    pool_mode: PoolMode = PoolMode.SOFTMAX
    qsa_dtype: CacheDtype = CacheDtype.BFLOAT16
    kernel_page_states: int = DEFAULT_KERNEL_PAGE_STATES

    def __post_init__(self) -> None:
        if not isinstance(self.family, CacheFamily):
            raise ValueError(f"family must be a CacheFamily, got {self.family!r}")
        _positive(num_layers=self.num_layers, vocab_size=self.vocab_size, index_heads=self.index_heads,
                  topk=self.topk, mla_entry_bytes=self.mla_entry_bytes, kpool=self.kpool,
                  compress_ratio=self.compress_ratio)
        if not isinstance(self.num_spec, int) or self.num_spec < 0:
            raise ValueError(f"num_spec must be an integer >= 0, got {self.num_spec!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.vocab_size < 2 or self.vocab_size > 1 << 20:
            raise ValueError(f"vocab_size must be in [2, 2**20], got {self.vocab_size}")
        self.cache_config()  # validates block size, ring size and the family's parameters

    @property
    def resolved_block_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return default_block_size(self.family, self.kpool, self.compress_ratio, self.num_spec)

    @property
    def group(self) -> int:
        """Tokens per compressed entry: kpool, or the QSA compress ratio."""
        return family_spec_type(self.family).tokens_per_entry_for(kpool=self.kpool, compress_ratio=self.compress_ratio)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"layer.{i}" for i in range(self.num_layers))

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            family=self.family, layer_names=self.layer_names, block_size=self.resolved_block_size,
            num_spec=self.num_spec, mla_entry_bytes=self.mla_entry_bytes, kpool=self.kpool,
            pool_mode=self.pool_mode, compress_ratio=self.compress_ratio, qsa_dtype=self.qsa_dtype,
            kernel_page_states=self.kernel_page_states,
        )

    def describe(self) -> dict[str, object]:
        return {
            "family": self.family.value, "layers": self.num_layers, "kpool": self.kpool,
            "compress_ratio": self.compress_ratio, "num_spec": self.num_spec,
            "block_size": self.resolved_block_size, "seed": self.seed, "vocab_size": self.vocab_size,
            "index_heads": self.index_heads, "topk": self.topk, "mla_entry_bytes": self.mla_entry_bytes,
            "kernel_page_states": self.kernel_page_states,
        }

    def identity(self) -> str:
        """The model's identity for a handshake: canonical JSON (sorted keys, no spaces) of every
        field that changes tokens or what the cache's bytes mean (``describe()`` plus the pool mode
        and the QSA dtype, less the block size and the kernel page, which only arrange the bytes:
        prefill and decode may differ in them, see ``connector.shared.compat``). Two nodes may exchange
        caches only when their identities are equal."""
        fields = {**self.describe(), "pool_mode": self.pool_mode.value, "qsa_dtype": self.qsa_dtype.value}
        for arranging in ("block_size", "kernel_page_states"):
            del fields[arranging]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))
