"""Block and ring allocators with exact free-count accounting.

Both detect a double free and an id that was never theirs, and raise ValueError naming it;
a failed call changes nothing.
"""

from __future__ import annotations

import heapq


class BlockAllocator:
    """Hands out block ids in [0, num_blocks), lowest first, so a request's blocks tend to
    form a few contiguous runs (a transfer then moves a handful of large regions)."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free_heap = list(range(num_blocks))
        self._allocated = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    def allocate(self, count: int) -> list[int]:
        """``count`` block ids, ascending. ValueError when fewer are free (nothing is taken)."""
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"block count must be an integer >= 0, got {count!r}")
        if count > len(self._free_heap):
            raise ValueError(f"cannot allocate {count} blocks: {len(self._free_heap)} of {self.num_blocks} free")
        ids = [heapq.heappop(self._free_heap) for _ in range(count)]
        for block_id in ids:
            self._allocated[block_id] = True
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Return blocks. The whole call is checked first: a foreign id, a double free or an id
        repeated in the list raises ValueError and frees nothing."""
        seen: set[int] = set()
        for block_id in block_ids:
            if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id!r} is not from this allocator (range [0, {self.num_blocks}))")
            if not self._allocated[block_id] or block_id in seen:
                raise ValueError(f"double free of block {block_id}")
            seen.add(block_id)
        for block_id in block_ids:
            self._allocated[block_id] = False
            heapq.heappush(self._free_heap, block_id)


class RingAllocator:
    """One ring block per request, keyed by request id."""

    def __init__(self, num_rings: int) -> None:
        if not isinstance(num_rings, int) or num_rings <= 0:
            raise ValueError(f"num_rings must be a positive integer, got {num_rings!r}")
        self.num_rings = num_rings
        self._blocks = BlockAllocator(num_rings)
        self._by_request: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return self._blocks.num_free

    def allocate(self, request_id: str) -> int:
        """The ring id of a new request. ValueError if the request already holds a ring or none is free."""
        if request_id in self._by_request:
            raise ValueError(f"request {request_id!r} already holds ring {self._by_request[request_id]}")
        if self._blocks.num_free == 0:
            raise ValueError(f"cannot allocate a ring for request {request_id!r}: all {self.num_rings} rings in use")
        (ring_id,) = self._blocks.allocate(1)
        self._by_request[request_id] = ring_id
        return ring_id

    def ring_of(self, request_id: str) -> int:
        if request_id not in self._by_request:
            raise ValueError(f"request {request_id!r} holds no ring")
        return self._by_request[request_id]

    def free(self, request_id: str) -> None:
        """Free the request's ring. ValueError for an unknown request (a double free included)."""
        if request_id not in self._by_request:
            raise ValueError(f"request {request_id!r} holds no ring (double free or foreign request)")
        self._blocks.free([self._by_request.pop(request_id)])
