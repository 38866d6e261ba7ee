"""Which of vLLM's KV cache groups the connector moves, and which of a request's blocks in each.

vLLM keeps one block table per KV cache group (``KVCacheConfig.kv_cache_groups``; ``KVCacheBlocks.
get_block_ids()`` and ``KVCacheManager.get_block_ids(request_id)`` are tuples with one list per group),
all drawing ids from one block pool whose block 0 is the null block, the placeholder a group's table
holds where it keeps nothing (``vllm/v1/core/block_pool.py``). The groups moved, by spec:

- ``FULL`` (``FullAttentionSpec``, ``MLAAttentionSpec`` with any ``tokens_per_state``, e.g. GLM-5-Next's
  and DeepSeek's indexer pages, QSA's compressed keys): block ``i`` holds positions ``[i * bs, (i + 1) * bs)``;
  a prompt of ``n`` tokens lies in the first ``cdiv(n, bs)`` blocks.
- ``WINDOW`` (``SlidingWindowSpec``, ``SlidingWindowMLASpec``): vLLM nulls the blocks before the window;
  the step after an ``n``-token prompt reads positions from ``n - window + 1`` on
  (``SlidingWindowManager.get_num_skipped_tokens``): the prompt's blocks from ``(n - window + 1) // bs`` on.
- ``RING`` (``CircularBufferSpec``: GLM-5-Next's tail, QSA's key-state ring): one block per request, written
  at ``pos % block_size`` (drafts' slots past the committed length included): the whole block.

Groups vLLM does not transfer (``enable_kv_transfer`` False: rebuilt from their source after a load)
are left out. Any other spec, a host-resident group, or a spec that lays its pages out itself is refused.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kpool_pd.vllm.ranks import Sharding

NULL_BLOCK_ID = 0  # vLLM's BlockPool takes block 0 as its null block


class GroupKind(enum.Enum):
    FULL = "full"
    WINDOW = "window"
    RING = "ring"


def layer_spec(spec: KVCacheSpec, layer_name: str) -> KVCacheSpec:
    """The spec of one layer of a group (a ``UniformTypeKVCacheSpecs`` group holds one per layer)."""
    return spec.kv_cache_specs[layer_name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec


def spec_kind(spec: KVCacheSpec) -> tuple[GroupKind, int]:
    """(kind, sliding window or 0) of one layer's spec; ValueError saying why for a spec not moved."""
    if not spec.has_layer_views:
        raise ValueError(f"{type(spec).__name__} lays its pages out itself (no per-layer view)")
    if isinstance(spec, CircularBufferSpec):
        return GroupKind.RING, 0
    if isinstance(spec, (ChunkedLocalAttentionSpec, RSWASpec, SinkFullAttentionSpec)):
        raise ValueError(f"{type(spec).__name__}: which of its blocks a decode step reads is not planned here")
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.WINDOW, spec.sliding_window
    if isinstance(spec, FullAttentionSpec):
        return GroupKind.FULL, 0
    raise ValueError(f"{type(spec).__name__} is not a paged attention cache KpoolPdConnector can plan "
                     "(full or sliding-window attention, MLA, or a per-request ring)")


@dataclass(frozen=True, kw_only=True)
class GroupRule:
    """Group ``group`` (vLLM's index) of ``kind`` with blocks of ``block_size`` tokens (``window``: the
    sliding window in tokens, 0 unless ``WINDOW``)."""

    group: int
    kind: GroupKind
    block_size: int
    window: int = 0

    def __post_init__(self) -> None:
        if self.group < 0 or self.block_size <= 0 or self.window < 0:
            raise ValueError(f"group {self.group}, block_size {self.block_size}, window {self.window}: "
                             "a group index >= 0, a positive block size and a window >= 0")
        if (self.kind is GroupKind.WINDOW) != (self.window > 0):
            raise ValueError(f"group {self.group}: a {self.kind.value} group with window {self.window}")

    def prompt_blocks(self, block_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        """The blocks of ``block_ids`` (the request's table in this group) that a decode step after a
        ``num_tokens``-token prompt reads. ValueError naming the group if one of them is the null block."""
        if self.kind is GroupKind.RING:
            chosen = list(block_ids)
        else:
            chosen = list(block_ids[:-(-num_tokens // self.block_size)])
            if self.kind is GroupKind.WINDOW:
                chosen = chosen[max(0, num_tokens - self.window + 1) // self.block_size:]
        if NULL_BLOCK_ID in chosen:
            raise ValueError(f"group {self.group} ({self.kind.value}): the {num_tokens}-token prompt's blocks "
                             f"{chosen[:8]} hold vLLM's null block")
        return tuple(chosen)


def transfer_rules(config: KVCacheConfig) -> tuple[GroupRule, ...]:
    """The rule of every group of ``config`` that moves. ValueError naming the group and why for a group
    vLLM transfers that this connector cannot move."""
    rules = []
    for index, group in enumerate(config.kv_cache_groups):
        if not group.enable_kv_transfer or not group.layer_names:
            continue
        spec = group.kv_cache_spec
        name = f"KV cache group {index} ({type(spec).__name__}, layers {group.layer_names[:3]})"
        if group.host_resident:
            raise ValueError(f"{name} cannot be moved: it lives in the host-resident pool")
        try:
            kinds = {spec_kind(layer_spec(spec, layer)) for layer in group.layer_names}
        except ValueError as exc:
            raise ValueError(f"{name} cannot be moved: {exc}") from None
        if len(kinds) != 1:
            raise ValueError(f"{name} cannot be moved: its layers mix kinds or windows {sorted(k.value for k, _ in kinds)}")
        kind, window = kinds.pop()
        rules.append(GroupRule(group=index, kind=kind, block_size=spec.block_size, window=window))
    if not rules:
        raise ValueError(f"none of the {len(config.kv_cache_groups)} KV cache groups is transferable")
    return tuple(rules)


def request_blocks(rules: Sequence[GroupRule], block_ids: Sequence[Sequence[int]],
                   num_tokens: int) -> tuple[tuple[int, ...], ...]:
    """One tuple per vLLM group (``block_ids``: the request's tables, one per group): the prompt's blocks
    in the groups moved, empty in the others."""
    chosen: list[tuple[int, ...]] = [() for _ in block_ids]
    for rule in rules:
        if rule.group >= len(block_ids):
            raise ValueError(f"a request with {len(block_ids)} block tables has no group {rule.group}")
        chosen[rule.group] = rule.prompt_blocks(block_ids[rule.group], num_tokens)
    return tuple(chosen)


def cached_block_ids(blocks) -> tuple[frozenset[int], ...]:
    """Per group, the ids of a request's blocks that vLLM's prefix cache filled (hashed, not the null
    block): its local hit. ``blocks``: the request's ``KVCacheBlocks``; blocks allocated for an asynchronous
    load are hashed only once it lands, so they are not among them."""
    return tuple(frozenset(b.block_id for b in group if b.block_hash is not None and not b.is_null)
                 for group in blocks.blocks)


def held_indices(rules: Sequence[GroupRule], chosen: Sequence[Sequence[int]],
                 cached: Sequence[frozenset[int]]) -> tuple[int, ...]:
    """Indices into ``chosen`` flattened group by group (``request_blocks``' result, as the connector names
    a request's blocks) of the blocks this engine's prefix cache holds: they are not pulled. A ring is
    never held: it is the producer's (a prefix hit covers whole blocks of the prompt, never its open pool)."""
    ring_groups = {rule.group for rule in rules if rule.kind is GroupKind.RING}
    held, index = [], 0
    for group, block_ids in enumerate(chosen):
        for block_id in block_ids:
            if group not in ring_groups and group < len(cached) and block_id in cached[group]:
                held.append(index)
            index += 1
    return tuple(held)


def splits_by_head(spec: KVCacheSpec) -> bool:
    """Whether TP splits a layer's cache of ``spec`` by KV head (full and sliding-window attention), rather
    than keeping it whole on every rank (MLA and its indexer pages, per-request rings)."""
    if isinstance(spec, (MLAAttentionSpec, CircularBufferSpec)) or "MLA" in type(spec).__name__:
        return False
    return isinstance(spec, (FullAttentionSpec, SlidingWindowSpec))


def sharding_of(config: KVCacheConfig, rules: Sequence[GroupRule]) -> Sharding:
    """How the groups of ``rules`` (those moved) lie across TP ranks: all split by head, all replicated,
    or mixed."""
    kinds = {splits_by_head(layer_spec(config.kv_cache_groups[rule.group].kv_cache_spec, layer))
             for rule in rules for layer in config.kv_cache_groups[rule.group].layer_names}
    if kinds == {True}:
        return Sharding.BY_HEAD
    return Sharding.REPLICATED if kinds == {False} else Sharding.MIXED
