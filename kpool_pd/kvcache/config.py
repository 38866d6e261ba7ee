"""One worker's cache configuration: the family, the layers, and the spec of every page."""

from __future__ import annotations

import functools

from dataclasses import dataclass, field

from kpool_pd.kvcache.family import Count, FamilySpec, KpoolFamilySpec, QsaFamilySpec, check_count
from kpool_pd.kvcache.specs import (
    DEFAULT_KERNEL_PAGE_STATES,
    DEFAULT_MLA_ENTRY_BYTES,
    BlockOrder,
    CacheDtype,
    CacheFamily,
    KpoolIndexerSpec,
    MlaPageSpec,
    PoolMode,
    QsaCompressedKeySpec,
    QsaKeyStateRingSpec,
    TailRingSpec,
)

LAYOUT_FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Everything that decides the bytes of a block and of a ring block.

    ``family`` picks the indexer page (kpool fp8 entries, or QSA compressed keys) and the ring
    (kpool tail ring, or QSA key state ring), both answered by ``family_spec``. Fields of the
    other family are ignored. ``kernel_page_states`` (kpool) is P, the states of one kernel page
    (32 or 64): a block of S > P states holds S / P pages; the layout hash covers the resulting
    states per page, min(S, P).
    """

    family: CacheFamily = CacheFamily.KPOOL
    layer_names: tuple[str, ...] = ("layer.0",)
    block_size: int = 256
    num_spec: int = 0
    mla_entry_bytes: int = DEFAULT_MLA_ENTRY_BYTES
    mla_num_heads: int = 1
    order: BlockOrder = BlockOrder.BLNHC
    # kpool family
    kpool: int = 4
    pool_mode: PoolMode = PoolMode.SOFTMAX
    round_scale: bool = True
    kernel_page_states: int = DEFAULT_KERNEL_PAGE_STATES
    # QSA family
    compress_ratio: int = 4
    qsa_head_size: int = 128
    qsa_num_heads: int = 1
    qsa_dtype: CacheDtype = CacheDtype.BFLOAT16
    cache_rope_positions: bool = False  # the seed's default (its models turn it on where they use MRoPE)
    format_version: int = field(default=LAYOUT_FORMAT_VERSION)

    def __post_init__(self) -> None:
        if not isinstance(self.family, CacheFamily):
            raise ValueError(f"family must be a CacheFamily, got {self.family!r}")
        if not self.layer_names:
            raise ValueError("layer_names must name at least one layer")
        seen: set[str] = set()
        for name in self.layer_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"layer name must be a non-empty string, got {name!r}")
            if name in seen:
                raise ValueError(f"duplicate layer name {name!r} in {self.layer_names}")
            seen.add(name)
        if not isinstance(self.order, BlockOrder):
            raise ValueError(f"order must be a BlockOrder, got {self.order!r}")
        # Building the specs validates every number.
        self.mla
        self.family_spec

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def mla(self) -> MlaPageSpec:
        return MlaPageSpec(
            block_size=self.block_size, entry_bytes=self.mla_entry_bytes,
            num_heads=self.mla_num_heads, order=self.order,
        )

    @property
    def kpool_indexer(self) -> KpoolIndexerSpec:
        return KpoolIndexerSpec(
            kpool=self.kpool, block_size=self.block_size, mode=self.pool_mode, round_scale=self.round_scale,
            kernel_page_states=self.kernel_page_states,
        )

    @property
    def tail_ring(self) -> TailRingSpec:
        return TailRingSpec(kpool=self.kpool, num_spec=self.num_spec, block_size=self.block_size)

    @property
    def qsa_keys(self) -> QsaCompressedKeySpec:
        return QsaCompressedKeySpec(
            compress_ratio=self.compress_ratio, block_size=self.block_size, head_size=self.qsa_head_size,
            num_heads=self.qsa_num_heads, dtype=self.qsa_dtype, order=self.order,
        )

    @property
    def qsa_ring(self) -> QsaKeyStateRingSpec:
        return QsaKeyStateRingSpec(
            compress_ratio=self.compress_ratio, num_spec=self.num_spec, block_size=self.block_size,
            head_size=self.qsa_head_size, num_heads=self.qsa_num_heads,
            cache_rope_positions=self.cache_rope_positions,
        )

    @functools.cached_property
    def family_spec(self) -> FamilySpec:
        """The family's page and ring specs behind one interface (``KpoolFamilySpec`` or ``QsaFamilySpec``);
        built once per config (the config is frozen), since the cache ops ask it every step."""
        if self.family is CacheFamily.KPOOL:
            return KpoolFamilySpec(indexer=self.kpool_indexer, ring=self.tail_ring)
        return QsaFamilySpec(keys=self.qsa_keys, ring=self.qsa_ring)

    @property
    def indexer_page_bytes(self) -> int:
        return self.family_spec.page_bytes

    @property
    def ring_slots(self) -> int:
        """R (kpool tail ring) or C (QSA key state ring)."""
        return self.family_spec.ring_slots

    @property
    def ring_row_bytes(self) -> int:
        """Bytes of one layer's row in one ring slot."""
        return self.family_spec.ring_row_bytes

    @property
    def tokens_per_entry(self) -> int:
        """Tokens per compressed entry: kpool, or the QSA compress ratio."""
        return self.family_spec.tokens_per_entry

    # block counts: every count of a node's blocks is one of these (a DCP rank's: ``kpool_pd.kvcache.dcp``) ------
    def blocks_for_tokens(self, num_tokens: Count) -> Count:
        """Blocks that hold positions ``[0, num_tokens)``: ceil(num_tokens / block_size); 0 for 0.
        An int (ValueError for a negative or non-integer count) or an integer tensor, elementwise."""
        check_count("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)

    @staticmethod
    def positions_written(prompt_len: int, max_new_tokens: int) -> int:
        """Positions a request writes at its largest: ``prompt_len + max_new_tokens - 1`` (the last output
        token is never written; drafts never pass it). ValueError naming both when that is negative."""
        written = prompt_len + max_new_tokens - 1
        if written < 0:
            raise ValueError(f"a request of {prompt_len} prompt and {max_new_tokens} new tokens writes "
                             f"{written} positions")
        return written

    def blocks_for_request(self, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks a request holds at its largest: those of ``positions_written``."""
        return self.blocks_for_tokens(self.positions_written(prompt_len, max_new_tokens))

    def max_cached_tokens(self, num_blocks: int) -> int:
        """Tokens that ``num_blocks`` blocks hold."""
        check_count("num_blocks", num_blocks)
        return num_blocks * self.block_size

    def complete_entries(self, num_tokens: Count) -> Count:
        """Compressed entries (pools, groups) complete after ``num_tokens`` committed tokens."""
        return self.family_spec.complete_entries(num_tokens)

    def open_entry_start(self, num_tokens: Count) -> Count:
        """First position of the open pool (group) after ``num_tokens`` committed tokens; the ring
        holds positions ``[open_entry_start(n), n)``, none when n is a multiple of the entry size."""
        return self.family_spec.open_entry_start(num_tokens)

    def hash_fields(self) -> dict[str, object]:
        """The parameters that change bytes, as plain values (the layout hash covers them)."""
        return {
            "format_version": self.format_version,
            "family": self.family.value,
            "layer_names": list(self.layer_names),
            "block_size": self.block_size,
            "num_spec": self.num_spec,
            "mla_entry_bytes": self.mla_entry_bytes,
            "mla_num_heads": self.mla_num_heads,
            "order": self.order.value,
        } | self.family_spec.hash_fields()
