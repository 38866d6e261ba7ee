"""The connector tests' prefill engines: each allocates from its node cache, hands the allocation
to the connector (``progress.serve_from``) and fills the request's blocks and ring with the seeded
bytes of ``tests.support.connector_bytes``, at once or chunk by chunk."""

from __future__ import annotations

import asyncio

from kpool_pd.connector import PrefillInput, PrefillOutput, PrefillProgress
from kpool_pd.kvcache import CacheAllocation, NodeCache
from tests.support.connector_bytes import expected_block, expected_ring


class SeededFillEngine:
    """A PrefillEngine that allocates from its node cache (``cache``: given, or set by whoever serves
    it, as ``InProcessPair`` does) and fills each block j of a request, and its ring, with bytes drawn
    from a generator seeded by (request id, j), so the decode side can regenerate what to expect."""

    def __init__(self, cache: NodeCache | None = None) -> None:
        self.cache = cache

    def _allocate(self, request: PrefillInput, progress: PrefillProgress) -> CacheAllocation:
        allocation = self.cache.allocate(request.request_id, self.cache.config.blocks_for_tokens(
            len(request.prompt_token_ids)))
        progress.serve_from(allocation)
        return allocation

    async def prefill(self, request: PrefillInput, progress: PrefillProgress) -> PrefillOutput:
        n = len(request.prompt_token_ids)
        allocation, pool = self._allocate(request, progress), self.cache.pool
        for j, b in enumerate(allocation.block_ids):
            pool.blocks[b] = expected_block(pool.layout, request.request_id, j)
        pool.rings[allocation.ring_id] = expected_ring(pool.layout, request.request_id)
        return PrefillOutput(prompt_len=n, first_token=sum(request.prompt_token_ids) % 50000)


class ChunkedFillEngine(SeededFillEngine):
    """SeededFillEngine in chunks of ``chunk_tokens``: before each chunk it awaits ``gate()`` (a pause, or the
    test's go-ahead); after it, the blocks the chunk completed hold their bytes and ``progress.advance`` says so;
    the ring is written with the last chunk. ``fail_after`` chunks: it raises instead of the next one;
    ``on_chunk(i)`` is called after chunk i (fault injection); ``linger_s``: the time it takes to return
    once every token is written (as a batch loop's step that still has other requests to finish)."""

    def __init__(self, chunk_tokens: int, gate, *, fail_after: int | None = None, on_chunk=None,
                 linger_s: float = 0.0, cache: NodeCache | None = None) -> None:
        super().__init__(cache)
        self.chunk_tokens, self.gate, self.fail_after, self.on_chunk = chunk_tokens, gate, fail_after, on_chunk
        self.linger_s = linger_s
        self.chunks_done = 0
        self.stopped = 0  # computations stopped (cancelled) before their last chunk

    async def prefill(self, request: PrefillInput, progress: PrefillProgress) -> PrefillOutput:
        n = len(request.prompt_token_ids)
        allocation, pool = self._allocate(request, progress), self.cache.pool
        layout, block_ids, ring_id = pool.layout, allocation.block_ids, allocation.ring_id
        size, written = layout.config.block_size, 0
        for index, start in enumerate(range(0, n, self.chunk_tokens)):
            try:
                await self.gate()
            except asyncio.CancelledError:
                self.stopped += 1
                raise
            if self.fail_after is not None and index >= self.fail_after:
                raise RuntimeError(f"injected failure before chunk {index}")
            end = min(n, start + self.chunk_tokens)
            while written < len(block_ids) and (end >= (written + 1) * size or end == n):
                pool.blocks[block_ids[written]] = expected_block(layout, request.request_id, written)
                written += 1
            if end == n:
                pool.rings[ring_id] = expected_ring(layout, request.request_id)
            progress.advance(end)
            self.chunks_done += 1
            if self.on_chunk is not None:
                self.on_chunk(index)
        await asyncio.sleep(self.linger_s)
        return PrefillOutput(prompt_len=n, first_token=sum(request.prompt_token_ids) % 50000)
