"""Cache specs, the unified block layout, allocators and the layout hash (imports no project package)."""

from kvcache.allocator import BlockAllocator, RingAllocator
from kvcache.config import LAYOUT_FORMAT_VERSION, CacheConfig
from kvcache.layout import BlockLayout, layout_differences, layout_hash
from kvcache.pool import CachePool
from kvcache.specs import (
    FP8_ENTRY_BYTES,
    INDEX_HEAD_DIM,
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
    "BlockAllocator", "BlockLayout", "BlockOrder", "CacheConfig", "CacheDtype", "CacheFamily",
    "CachePool", "FP8_ENTRY_BYTES", "INDEX_HEAD_DIM", "KpoolIndexerSpec", "LAYOUT_FORMAT_VERSION",
    "MlaPageSpec", "PoolMode", "QsaCompressedKeySpec", "QsaKeyStateRingSpec", "RingAllocator",
    "TailRingSpec", "layout_differences", "layout_hash", "qsa_ring_capacity", "tail_ring_size",
]
