"""Allocations at block ids a test chose (out of order, with gaps), for engine tests that place a request's
blocks themselves on a pool no ``NodeCache`` allocates from."""

from __future__ import annotations

from collections.abc import Sequence

from kpool_pd.kvcache import CacheAllocation, CachePool


class _Placed:
    """The cache of a placed allocation: its pool; releasing it frees nothing (nothing was taken)."""

    def __init__(self, pool: CachePool) -> None:
        self.pool = pool

    def _give_back(self, allocation: CacheAllocation) -> None:
        pass


class _PlacedAllocation(CacheAllocation):
    """An allocation that took nothing from a cache: dropping it unreleased leaks nothing, so it reports nothing."""

    __slots__ = ()

    def __del__(self) -> None:
        pass


def placed(pool: CachePool, block_ids: Sequence[int], ring_id: int, owner: str = "r") -> CacheAllocation:
    """Blocks ``block_ids`` (block-table order) and ring ``ring_id`` of ``pool`` as an allocation."""
    return _PlacedAllocation(_Placed(pool), owner, f"{owner}#placed", tuple(block_ids), ring_id)
