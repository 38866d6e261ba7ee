"""One node's cache and its only owner: the pool, its block and ring allocators, and the allocations
handed out from them.

Every block and ring a node uses is taken here, as a ``CacheAllocation``: a request's blocks and,
unless it asks for none, its ring. The engine that computes a request (a prefill engine, the decode
scheduler, the colocated runner, a DCP rank, a warm-up) holds the handle; the connector only moves
bytes between allocations it is handed. Whoever is done with a request releases its handle;
``release()`` is idempotent, so every path a request may leave by can call it. A handle collected
while still held reports the leak (``__del__`` only logs: it frees nothing, a leak is a bug to find).

Not thread-safe: a node allocates and releases from one thread (its event loop, or the runner's).
"""

from __future__ import annotations

import logging

import torch

from kpool_pd.kvcache.allocator import BlockAllocator, RingAllocator
from kpool_pd.kvcache.config import CacheConfig
from kpool_pd.kvcache.layout import BlockLayout
from kpool_pd.kvcache.pool import CachePool

logger = logging.getLogger(__name__)


class CacheExhaustedError(Exception):
    """Too few free blocks or rings for an allocation; nothing was taken."""


class CacheAllocation:
    """A request's blocks (``block_ids``, in block-table order) and ring (``ring_id``, or None) in one
    node's cache, held until ``release()``. A context manager that releases on exit."""

    __slots__ = ("owner", "key", "_block_ids", "ring_id", "_cache", "_released")

    def __init__(self, cache: "NodeCache", owner: str, key: str, block_ids: tuple[int, ...], ring_id: int | None) -> None:
        self._cache = cache
        self.owner = owner  # who it is for, in messages (a request id; several allocations may share it)
        self.key = key  # unique in its cache
        self._block_ids = block_ids
        self.ring_id = ring_id
        self._released = False

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self._block_ids

    @property
    def num_blocks(self) -> int:
        return len(self._block_ids)

    @property
    def pool(self) -> CachePool:
        """The pool whose blocks and ring these are."""
        return self._cache.pool

    @property
    def released(self) -> bool:
        return self._released

    def extend(self, num_blocks: int) -> tuple[int, ...]:
        """Take ``num_blocks`` more blocks, appended to the block table; returns the new ids.
        CacheExhaustedError (nothing taken) when short; ValueError once released."""
        if self._released:
            raise ValueError(f"allocation of {self.owner!r} was released; it cannot grow")
        added = self._cache._take_blocks(self.owner, num_blocks)
        self._block_ids += added
        return added

    def release(self) -> None:
        """Give the blocks and the ring back (idempotent)."""
        if not self._released:
            self._released = True
            self._cache._give_back(self)

    def __enter__(self) -> "CacheAllocation":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            logger.error("the cache allocation of %r was never released: %d blocks%s leak", self.owner,
                         len(self._block_ids), "" if self.ring_id is None else " and a ring")

    def __repr__(self) -> str:
        return (f"CacheAllocation({self.owner!r}, blocks={len(self._block_ids)}, ring={self.ring_id}, "
                f"{'released' if self._released else 'held'})")


class NodeCache:
    """A node's pool (``pool``: the bytes and their typed views) and the allocations out of it."""

    def __init__(self, layout: BlockLayout | CacheConfig, *, num_blocks: int, num_rings: int,
                 device: str | torch.device = "cpu") -> None:
        if isinstance(layout, CacheConfig):
            layout = BlockLayout(layout)
        self.pool = CachePool(layout, num_blocks=num_blocks, num_rings=num_rings, device=device)
        self._blocks = BlockAllocator(num_blocks)
        self._rings = RingAllocator(num_rings)
        self._held = 0
        self._serial = 0  # makes each allocation's key unique

    # what the node has --------------------------------------------------------------------
    @property
    def layout(self) -> BlockLayout:
        return self.pool.layout

    @property
    def config(self) -> CacheConfig:
        return self.pool.config

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_rings(self) -> int:
        return self.pool.num_rings

    @property
    def free_blocks(self) -> int:
        return self._blocks.num_free

    @property
    def free_rings(self) -> int:
        return self._rings.num_free

    @property
    def allocations_held(self) -> int:
        """Allocations handed out and not yet released."""
        return self._held

    def fits(self, num_blocks: int, *, ring: bool = True) -> bool:
        """Whether ``allocate`` of ``num_blocks`` (and a ring) would succeed now."""
        return num_blocks <= self._blocks.num_free and (not ring or self._rings.num_free > 0)

    # allocation ---------------------------------------------------------------------------
    def allocate(self, owner: str, num_blocks: int, *, ring: bool = True) -> CacheAllocation:
        """``num_blocks`` blocks (lowest ids first) and, with ``ring``, a ring, for ``owner`` (a label for
        messages: a request id). CacheExhaustedError when too few are free, ValueError for an empty owner
        or a ``num_blocks`` that is not an integer >= 0; either way nothing is taken."""
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"an allocation's owner must be a non-empty string, got {owner!r}")
        if type(num_blocks) is not int or num_blocks < 0:
            raise ValueError(f"block count must be an integer >= 0, got {num_blocks!r}")
        if not self.fits(num_blocks, ring=ring):
            raise CacheExhaustedError(
                f"{owner} needs {num_blocks} blocks{' and a ring' if ring else ''}; free: {self._blocks.num_free} "
                f"of {self.num_blocks} blocks, {self._rings.num_free} of {self.num_rings} rings")
        self._serial += 1
        key = f"{owner}#{self._serial}"
        ring_id = self._rings.allocate(key) if ring else None
        allocation = CacheAllocation(self, owner, key, tuple(self._blocks.allocate(num_blocks)), ring_id)
        self._held += 1
        return allocation

    def _take_blocks(self, owner: str, num_blocks: int) -> tuple[int, ...]:
        if type(num_blocks) is not int or num_blocks < 0:
            raise ValueError(f"block count must be an integer >= 0, got {num_blocks!r}")
        if num_blocks > self._blocks.num_free:
            raise CacheExhaustedError(f"{owner} needs {num_blocks} more blocks; free: {self._blocks.num_free} "
                                      f"of {self.num_blocks}")
        return tuple(self._blocks.allocate(num_blocks))

    def _give_back(self, allocation: CacheAllocation) -> None:
        self._blocks.free(list(allocation.block_ids))
        if allocation.ring_id is not None:
            self._rings.free(allocation.key)
        self._held -= 1

    def __repr__(self) -> str:
        return (f"NodeCache({self.free_blocks}/{self.num_blocks} blocks free, {self.free_rings}/{self.num_rings} "
                f"rings free, {self._held} allocations held, {self.device})")
