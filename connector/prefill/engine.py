"""What the prefill connector asks of the model side: the PrefillEngine protocol.

The connector owns the allocators and the leases; the engine computes. For each Prefill RPC
the connector calls ``engine.prefill(request, cache)`` once; the engine allocates through
``cache.allocate`` (at most once), fills the blocks and the ring, and returns a
``PrefillOutput``. If it raises, the connector frees whatever it allocated and answers the RPC
with an error (``CacheExhaustedError`` -> RESOURCE_EXHAUSTED, ``EngineUnavailable`` ->
UNAVAILABLE, ``ValueError`` -> INVALID_ARGUMENT, anything else -> INTERNAL). If the caller
gives up (its deadline passes, it cancels), the connector cancels the awaited ``prefill`` and
frees the allocation as soon as the cancellation reaches it; an engine that still writes to
those blocks afterwards must finish before any later request's writes can reach them (a
batch loop that runs one batch at a time does).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from connector.shared.errors import CacheExhaustedError
from kvcache import BlockAllocator, CachePool, RingAllocator


@dataclass(frozen=True, kw_only=True)
class PrefillInput:
    """One Prefill call: the decode node's request id and the prompt (1 to ``max_prompt_tokens`` ids)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class PrefillOutput:
    """What the engine returns: the blocks and ring it took through ``cache.allocate``, the
    prompt length, and the first token."""

    block_ids: tuple[int, ...]
    ring_id: int
    prompt_len: int
    first_token: int


class PrefillCache:
    """One Prefill call's access to the prefill node's cache: the pool, and allocation that the
    connector can roll back. Not thread-safe; used from the event loop only."""

    __slots__ = ("pool", "_blocks", "_rings", "_key", "block_ids", "ring_id", "prefilled", "_moved", "_allocated")

    def __init__(self, pool: CachePool, blocks: BlockAllocator, rings: RingAllocator, key: str) -> None:
        self.pool = pool
        self._blocks = blocks
        self._rings = rings
        self._key = key
        self.block_ids: tuple[int, ...] | None = None
        self.ring_id: int | None = None
        self.prefilled = 0  # prompt tokens written in every layer (``advance``)
        self._moved = asyncio.Event()  # set (and replaced) by each ``advance``
        self._allocated = asyncio.Event()

    def allocate(self, num_blocks: int) -> tuple[tuple[int, ...], int]:
        """``num_blocks`` blocks and one ring. CacheExhaustedError (nothing taken) when short."""
        if self.block_ids is not None:
            raise RuntimeError("PrefillCache.allocate may be called once per request")
        if num_blocks > self._blocks.num_free or self._rings.num_free == 0:
            raise CacheExhaustedError(
                f"need {num_blocks} blocks and a ring; free: {self._blocks.num_free} blocks, {self._rings.num_free} rings")
        self.block_ids = tuple(self._blocks.allocate(num_blocks))
        self.ring_id = self._rings.allocate(self._key)
        self._allocated.set()
        return self.block_ids, self.ring_id

    async def wait_allocated(self) -> None:
        """Until ``allocate`` succeeded (never returns if the engine fails first: wait on it too)."""
        await self._allocated.wait()

    def advance(self, tokens: int) -> None:
        """The engine says the prompt's first ``tokens`` tokens are written in every layer (after each chunk;
        the prompt's length once it is done). Wakes ``wait_prefilled``; never goes back."""
        if tokens > self.prefilled:
            self.prefilled = tokens
            moved, self._moved = self._moved, asyncio.Event()
            moved.set()

    async def wait_prefilled(self, tokens: int) -> None:
        """Until at least ``tokens`` prompt tokens are written (the caller bounds the wait and watches the
        engine's own failure)."""
        while self.prefilled < tokens:
            await self._moved.wait()

    def rollback(self) -> None:
        """Free what ``allocate`` took (idempotent)."""
        if self.block_ids is not None:
            self._blocks.free(list(self.block_ids))
            self._rings.free(self._key)
            self.block_ids, self.ring_id = None, None


class PrefillEngine(Protocol):
    async def prefill(self, request: PrefillInput, cache: PrefillCache) -> PrefillOutput:
        """Run the prompt: allocate ``config.blocks_for_tokens(len(prompt))`` blocks and a ring through
        ``cache.allocate`` as soon as it can (a pipelined Prefill call is answered once it has), fill them (in chunks or whole, calling
        ``cache.advance(tokens)`` as prompt tokens are written in every layer, at the latest with the
        prompt's length), and return their ids, the prompt length and the first output token. Called once
        per request, from the connector's event loop."""
        ...
