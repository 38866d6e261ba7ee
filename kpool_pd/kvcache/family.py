"""One object per cache family: what a block's indexer page and a ring slot hold for that family.

``CacheConfig.family_spec`` builds it; callers ask it (page bytes, ring slots, ring row bytes,
tokens per compressed entry, the family's hashed fields) instead of branching on the family.

Also here: the token arithmetic both families share, written once (the block counts are
``CacheConfig``'s and, for a DCP rank, ``kpool_pd.kvcache.dcp``'s):

- ``complete_entries(n, g)``: compressed entries (kpool pools, QSA groups) complete after ``n``
  tokens, ``g`` tokens each;
- ``open_entry_start(n, g)``: the first position of the entry still open after ``n`` tokens
  (``n`` itself when every entry is complete); the ring holds positions ``[start, n)``.

Each takes a plain ``int`` (checked: ``ValueError`` for a negative or non-integer count) or an
integer tensor of counts (elementwise; not range-checked, so that no device sync is forced).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from kpool_pd.kvcache.specs import (
    CacheFamily,
    KpoolIndexerSpec,
    QsaCompressedKeySpec,
    QsaKeyStateRingSpec,
    TailRingSpec,
    qsa_ring_capacity,
    tail_ring_size,
)

Count = TypeVar("Count", int, torch.Tensor)


def check_count(name: str, value: int | torch.Tensor) -> None:
    """``value`` is an integer >= 0 or an integer tensor (not range-checked: no device sync); ValueError
    or TypeError naming it otherwise."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def complete_entries(num_tokens: Count, tokens_per_entry: int) -> Count:
    """Entries of ``tokens_per_entry`` tokens complete after ``num_tokens`` tokens: floor(n / g)."""
    check_count("num_tokens", num_tokens)
    _check_positive("tokens_per_entry", tokens_per_entry)
    return num_tokens // tokens_per_entry


def open_entry_start(num_tokens: Count, tokens_per_entry: int) -> Count:
    """First position of the open entry after ``num_tokens`` tokens: floor(n / g) * g. The open
    entry holds positions ``[start, n)``, empty when ``n`` is a multiple of ``g``."""
    return complete_entries(num_tokens, tokens_per_entry) * tokens_per_entry


class _EntryArithmetic(abc.ABC):
    """Token arithmetic of a family whose entries hold ``tokens_per_entry`` tokens each."""

    @property
    @abc.abstractmethod
    def tokens_per_entry(self) -> int:
        """Tokens per compressed entry."""

    def complete_entries(self, num_tokens: Count) -> Count:
        """Entries complete after ``num_tokens`` tokens (see ``complete_entries``)."""
        return complete_entries(num_tokens, self.tokens_per_entry)

    def open_entry_start(self, num_tokens: Count) -> Count:
        """First position of the open entry after ``num_tokens`` tokens (see ``open_entry_start``)."""
        return open_entry_start(num_tokens, self.tokens_per_entry)


@dataclass(frozen=True, kw_only=True)
class KpoolFamilySpec(_EntryArithmetic):
    """kpool family: a layer's indexer pages hold S fp8 entries of one pool of ``kpool`` tokens each,
    in kernel pages of ``states_per_page`` entries; the tail ring holds R slots of raw K and gate."""

    family: ClassVar[CacheFamily] = CacheFamily.KPOOL
    supports_dcp: ClassVar[bool] = True  # pools shard over decode-context-parallel ranks
    indexer: KpoolIndexerSpec
    ring: TailRingSpec

    def __post_init__(self) -> None:
        if not isinstance(self.indexer, KpoolIndexerSpec):
            raise TypeError(f"indexer must be a KpoolIndexerSpec, got {type(self.indexer).__name__}")
        if not isinstance(self.ring, TailRingSpec):
            raise TypeError(f"ring must be a TailRingSpec, got {type(self.ring).__name__}")
        if (self.indexer.kpool, self.indexer.block_size) != (self.ring.kpool, self.ring.block_size):
            raise ValueError(
                f"indexer (kpool {self.indexer.kpool}, block_size {self.indexer.block_size}) and ring "
                f"(kpool {self.ring.kpool}, block_size {self.ring.block_size}) disagree"
            )

    @staticmethod
    def tokens_per_entry_for(*, kpool: int, compress_ratio: int) -> int:
        """The family's entry size from a config's parameters (before a block size is known): kpool."""
        return kpool

    @staticmethod
    def ring_slots_for(tokens_per_entry: int, num_spec: int) -> int:
        """R for a kpool of ``tokens_per_entry`` and ``num_spec`` drafts (no block size needed)."""
        return tail_ring_size(tokens_per_entry, num_spec)

    @property
    def tokens_per_entry(self) -> int:
        """kpool: tokens per pool."""
        return self.indexer.kpool

    @property
    def entries_per_block(self) -> int:
        """S = block_size / kpool."""
        return self.indexer.states_per_block

    @property
    def states_per_page(self) -> int:
        """States of one kernel page: min(S, P)."""
        return self.indexer.states_per_page

    @property
    def pages_per_block(self) -> int:
        """Kernel pages of one layer in one block."""
        return self.indexer.pages_per_block

    @property
    def page_bytes(self) -> int:
        """One layer's indexer pages in one block (every kernel page, back to back): S * 132."""
        return self.indexer.page_bytes

    @property
    def page_axes(self) -> tuple[int, int, int]:
        """The page as (rows, heads, row bytes): no head axis, so one row of the whole page, the
        same bytes in either block order."""
        return 1, 1, self.indexer.page_bytes

    @property
    def ring_slots(self) -> int:
        """R."""
        return self.ring.ring_size

    @property
    def ring_row_bytes(self) -> int:
        """One layer's row in one ring slot: bf16[2, 128]."""
        return self.ring.row_bytes

    def hash_fields(self) -> dict[str, object]:
        """The family's parameters that change bytes, as plain values."""
        return {
            "kpool": self.indexer.kpool,
            "pool_mode": self.indexer.mode.value,
            "round_scale": self.indexer.round_scale,
            "states_per_block": self.indexer.states_per_block,
            "states_per_page": self.indexer.states_per_page,
            "ring_size": self.ring.ring_size,
        }


@dataclass(frozen=True, kw_only=True)
class QsaFamilySpec(_EntryArithmetic):
    """QSA family: the indexer page holds compressed key rows of one group of ``r`` tokens each;
    the key state ring holds C rows of raw keys (and packed positions)."""

    family: ClassVar[CacheFamily] = CacheFamily.QSA
    supports_dcp: ClassVar[bool] = False  # declares no decode-context-parallel support
    keys: QsaCompressedKeySpec
    ring: QsaKeyStateRingSpec

    def __post_init__(self) -> None:
        if not isinstance(self.keys, QsaCompressedKeySpec):
            raise TypeError(f"keys must be a QsaCompressedKeySpec, got {type(self.keys).__name__}")
        if not isinstance(self.ring, QsaKeyStateRingSpec):
            raise TypeError(f"ring must be a QsaKeyStateRingSpec, got {type(self.ring).__name__}")
        ours = (self.keys.compress_ratio, self.keys.block_size, self.keys.head_size, self.keys.num_heads)
        theirs = (self.ring.compress_ratio, self.ring.block_size, self.ring.head_size, self.ring.num_heads)
        if ours != theirs:
            raise ValueError(
                f"keys (compress_ratio, block_size, head_size, num_heads) = {ours} and ring {theirs} disagree"
            )

    @staticmethod
    def tokens_per_entry_for(*, kpool: int, compress_ratio: int) -> int:
        """The family's entry size from a config's parameters (before a block size is known): r."""
        return compress_ratio

    @staticmethod
    def ring_slots_for(tokens_per_entry: int, num_spec: int) -> int:
        """C for a compress ratio of ``tokens_per_entry`` and ``num_spec`` drafts (no block size needed)."""
        return qsa_ring_capacity(tokens_per_entry, num_spec)

    @property
    def tokens_per_entry(self) -> int:
        """r: tokens per group (the compress ratio)."""
        return self.keys.compress_ratio

    @property
    def entries_per_block(self) -> int:
        """block_size / r compressed rows."""
        return self.keys.rows_per_block

    @property
    def page_bytes(self) -> int:
        """One layer's compressed key page in one block."""
        return self.keys.page_bytes

    @property
    def page_axes(self) -> tuple[int, int, int]:
        """The page as (rows, heads, row bytes): stored [rows, H, D] (BLNHC) or [H, rows, D] (BLHNC)."""
        return self.keys.rows_per_block, self.keys.num_heads, self.keys.head_size * self.keys.element_bytes

    @property
    def ring_slots(self) -> int:
        """C."""
        return self.ring.capacity

    @property
    def ring_row_bytes(self) -> int:
        """One layer's row in one ring slot: bf16[H, W]."""
        return self.ring.row_bytes

    def hash_fields(self) -> dict[str, object]:
        """The family's parameters that change bytes, as plain values."""
        keys = self.keys
        return {
            "compress_ratio": keys.compress_ratio,
            "qsa_head_size": keys.head_size,
            "qsa_num_heads": keys.num_heads,
            "qsa_dtype": keys.dtype.canonical.value,
            "cache_rope_positions": self.ring.cache_rope_positions,
            "ring_capacity": self.ring.capacity,
            "rotary_dim": keys.rotary_dim,
            "mrope_section": list(keys.mrope_section),
            "rope_theta": keys.rope_theta,
            "norm_eps": keys.norm_eps,
        }


FamilySpec = KpoolFamilySpec | QsaFamilySpec

_SPEC_TYPES: dict[CacheFamily, type[KpoolFamilySpec] | type[QsaFamilySpec]] = {
    CacheFamily.KPOOL: KpoolFamilySpec, CacheFamily.QSA: QsaFamilySpec,
}


def family_spec_type(family: CacheFamily) -> type[KpoolFamilySpec] | type[QsaFamilySpec]:
    """The spec class of a family (``CacheConfig.family_spec`` builds its spec): ``tokens_per_entry_for``
    and ``ring_slots_for`` answer what is known before a block size is."""
    if not isinstance(family, CacheFamily):
        raise ValueError(f"family must be a CacheFamily, got {family!r}")
    return _SPEC_TYPES[family]
