"""The cache of a node whose engine keeps its own block manager (vLLM): the one owner is the engine.

``EngineCache`` allocates nothing. It wraps block ids the engine already allocated as a
``CacheAllocation`` (``lend``), so that the connector moves bytes between allocations exactly as it does
on a node whose ``NodeCache`` allocates; releasing the handle (idempotent) hands the blocks back to the
engine through the ``on_release`` callback the engine gave, which is where the engine frees them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kpool_pd.kvcache.node_cache import CacheAllocation
from kpool_pd.kvcache.planar import PlanarLayout, PlanarPool

logger = logging.getLogger(__name__)


class EngineCache:
    """``pool`` (the engine's planes) and the allocations lent out of it. Not thread-safe: lend and
    release from one thread (the connector's event loop)."""

    def __init__(self, pool: PlanarPool) -> None:
        self.pool = pool
        self._on_release: dict[str, Callable[[], None]] = {}
        self._serial = 0

    @property
    def layout(self) -> PlanarLayout:
        return self.pool.layout

    @property
    def allocations_held(self) -> int:
        """Allocations lent and not yet released."""
        return len(self._on_release)

    def lend(self, owner: str, block_ids: Sequence[int], *, on_release: Callable[[], None]) -> CacheAllocation:
        """The engine's blocks ``block_ids`` (block-table order) of request ``owner`` as an allocation;
        ``on_release`` runs once, when it is released. ValueError for an empty owner or an id outside
        the pool (nothing lent)."""
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"an allocation's owner must be a non-empty string, got {owner!r}")
        ids = tuple(block_ids)
        bad = [b for b in ids if type(b) is not int or not 0 <= b < self.pool.num_blocks]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"{owner}: block ids must be distinct and in [0, {self.pool.num_blocks}), "
                             f"got {list(ids)[:16]}")
        self._serial += 1
        key = f"{owner}#{self._serial}"
        self._on_release[key] = on_release
        return CacheAllocation(self, owner, key, ids, None)

    def _take_blocks(self, owner: str, num_blocks: int) -> tuple[int, ...]:
        raise ValueError(f"{owner}: the engine allocates this node's blocks; a lent allocation cannot grow")

    def _give_back(self, allocation: CacheAllocation) -> None:
        on_release = self._on_release.pop(allocation.key)
        try:
            on_release()
        except Exception:  # the engine's callback: the blocks are the engine's to free, log and go on
            logger.exception("the engine's release of %r failed", allocation.owner)

    def __repr__(self) -> str:
        return f"EngineCache({self.pool.num_blocks} blocks, {len(self._on_release)} lent, {self.pool.device})"
