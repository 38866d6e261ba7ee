"""What the prefill connector asks of the model side: the PrefillEngine protocol.

One owner per node: the engine owns the node's cache (a ``kvcache.NodeCache``) and allocates from
it; the connector never allocates, it serves the bytes of the allocation the engine hands it and
holds that handle under lease. For each Prefill RPC the connector calls
``engine.prefill(request, progress)`` once (who calls: the connector, on its event loop; never
twice for one call). The engine allocates the prompt's blocks and a ring, hands the allocation to
``progress.serve_from`` at once (a pipelined Prefill call is answered then), fills the blocks
(``progress.advance`` after each chunk) and returns a ``PrefillOutput``.

Failure: an engine that raises before ``serve_from`` releases what it took itself; from
``serve_from`` on the allocation is the grant's, and the connector releases it when the grant ends
(pulled and released, its lease expired, the call failed or was cancelled). The connector answers
a raised ``CacheExhaustedError`` with RESOURCE_EXHAUSTED, ``EngineUnavailable`` with UNAVAILABLE,
``ValueError`` with INVALID_ARGUMENT and anything else with INTERNAL. If the caller gives up (its
deadline passes, it cancels), the connector cancels the awaited ``prefill`` and releases the
allocation as soon as the cancellation reaches it; an engine that still writes to those blocks
afterwards must finish before any later request's writes can reach them (a batch loop that runs one
batch at a time does). Releasing is idempotent, so the engine may release an allocation it
abandons too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kpool_pd.kvcache import CacheAllocation


@dataclass(frozen=True, kw_only=True)
class PrefillInput:
    """One Prefill call: the decode node's request id and the prompt (1 to ``max_prompt_tokens`` ids), and the prompt's
    MRoPE positions as the wire carries them (time, height, width of each token in turn; empty: text), which the
    engine checks (a ValueError: INVALID_ARGUMENT)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    mrope_positions: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PrefillOutput:
    """What the engine returns once the prompt is computed: its length and the first output token."""

    prompt_len: int
    first_token: int


class PrefillProgress:
    """One Prefill call's hand-off between the engine and the connector: the allocation the engine
    serves the request from (``serve_from``), and how far the prompt is written (``advance``). Not
    thread-safe; used from the event loop only."""

    __slots__ = ("request_id", "allocation", "prefilled", "written_at", "_moved", "_allocated", "_listeners")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.allocation: CacheAllocation | None = None
        self.prefilled = 0  # prompt tokens written in every layer (``advance``)
        self.written_at = 0.0  # when (perf_counter) ``prefilled`` last moved on
        self._moved = asyncio.Event()  # set (and replaced) by each ``advance``
        self._allocated = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []  # called within each ``advance`` (``listen``)

    def serve_from(self, allocation: CacheAllocation) -> None:
        """The engine's allocation for this request (its blocks in block-table order and its ring),
        handed over once; from now on the grant holds it and releases it. ValueError for a released
        allocation or one without a ring (where the layout has rings); RuntimeError when called twice."""
        if self.allocation is not None:
            raise RuntimeError(f"PrefillProgress.serve_from may be called once per request ({self.request_id})")
        if allocation.released or (allocation.ring_id is None and allocation.pool.layout.ring_slots):
            raise ValueError(f"request {self.request_id} must be served from a held allocation with a ring, "
                             f"got {allocation!r}")
        self.allocation = allocation
        self._allocated.set()

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.allocation.block_ids if self.allocation is not None else ()

    @property
    def ring_id(self) -> int | None:
        return self.allocation.ring_id if self.allocation is not None else None

    async def wait_allocated(self) -> None:
        """Until ``serve_from`` was called (never returns if the engine fails first: wait on it too)."""
        await self._allocated.wait()

    def advance(self, tokens: int) -> None:
        """The engine says the prompt's first ``tokens`` tokens are written in every layer (after each chunk;
        the prompt's length once it is done). Wakes ``wait_prefilled``; never goes back."""
        if tokens > self.prefilled:
            self.prefilled, self.written_at = tokens, time.perf_counter()
            moved, self._moved = self._moved, asyncio.Event()
            moved.set()
            for listener in tuple(self._listeners):
                listener()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` within every later ``advance`` that moves the prompt on, before it returns: a
        pushed pull posts the sends the engine's chunk made ready from the chunk's end, with no loop step in
        between. A listener must not raise (it keeps its own failures) and is removed with ``unlisten``."""
        self._listeners.append(listener)

    def unlisten(self, listener: Callable[[], None]) -> None:
        """Remove ``listener`` (idempotent)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    async def wait_prefilled(self, tokens: int) -> None:
        """Until at least ``tokens`` prompt tokens are written (the caller bounds the wait and watches the
        engine's own failure)."""
        while self.prefilled < tokens:
            await self._moved.wait()

    def release(self) -> None:
        """Release the allocation served from, if any (idempotent)."""
        if self.allocation is not None:
            self.allocation.release()


class PrefillEngine(Protocol):
    async def prefill(self, request: PrefillInput, progress: PrefillProgress) -> PrefillOutput:
        """Run the prompt: allocate ``config.blocks_for_tokens(len(prompt))`` blocks and a ring from the
        node's cache and hand them to ``progress.serve_from`` as soon as it can, fill them (in chunks or
        whole, calling ``progress.advance(tokens)`` as prompt tokens are written in every layer, at the
        latest with the prompt's length), and return the prompt length and the first output token.
        Called once per request, from the connector's event loop."""
        ...
