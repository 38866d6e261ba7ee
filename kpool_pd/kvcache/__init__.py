"""Cache specs, the unified block layout, the layout hash, and a node's cache with its only owner
(``NodeCache``: the pool, the allocators, the allocations it hands out); imports no project package."""

from kpool_pd.kvcache.allocator import BlockAllocator, RingAllocator
from kpool_pd.kvcache.config import LAYOUT_FORMAT_VERSION, CacheConfig
from kpool_pd.kvcache.engine_cache import EngineCache
from kpool_pd.kvcache.dcp import DcpConfig, DcpShard, family_supports_dcp
from kpool_pd.kvcache.family import (
    FamilySpec,
    KpoolFamilySpec,
    QsaFamilySpec,
    complete_entries,
    family_spec_type,
    open_entry_start,
)
from kpool_pd.kvcache.layout import BlockLayout, FieldGeometry, FieldKind, layout_differences, layout_hash
from kpool_pd.kvcache.node_cache import CacheAllocation, CacheExhaustedError, NodeCache
from kpool_pd.kvcache.planar import PlanarCacheConfig, PlanarLayout, PlanarPool
from kpool_pd.kvcache.pool import CachePool
from kpool_pd.kvcache.specs import (
    DEFAULT_KERNEL_PAGE_STATES,
    DEFAULT_MLA_ENTRY_BYTES,
    FP8_ENTRY_BYTES,
    INDEX_HEAD_DIM,
    KERNEL_PAGE_STATES,
    BlockOrder,
    CacheDtype,
    CacheFamily,
    KpoolIndexerSpec,
    MlaPageSpec,
    PoolMode,
    QsaCompressedKeySpec,
    QsaKeyStateRingSpec,
    TailRingSpec,
    qsa_ring_capacity,
    tail_ring_size,
)

__all__ = [
    "BlockAllocator", "BlockLayout", "FieldGeometry", "FieldKind", "CacheAllocation", "CacheExhaustedError", "BlockOrder", "CacheConfig", "CacheDtype", "CacheFamily",
    "CachePool", "DEFAULT_KERNEL_PAGE_STATES", "DEFAULT_MLA_ENTRY_BYTES", "DcpConfig", "DcpShard", "EngineCache", "FP8_ENTRY_BYTES", "FamilySpec",
    "INDEX_HEAD_DIM", "KERNEL_PAGE_STATES", "KpoolFamilySpec", "KpoolIndexerSpec",
    "LAYOUT_FORMAT_VERSION", "MlaPageSpec", "NodeCache", "PlanarCacheConfig", "PlanarLayout", "PlanarPool", "PoolMode", "QsaCompressedKeySpec", "QsaFamilySpec",
    "QsaKeyStateRingSpec", "RingAllocator", "TailRingSpec", "complete_entries",
    "family_spec_type", "family_supports_dcp", "layout_differences", "layout_hash", "open_entry_start", "qsa_ring_capacity",
    "tail_ring_size",
]
