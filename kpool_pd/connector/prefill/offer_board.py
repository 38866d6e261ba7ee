"""The grants a producer holds for a decode engine named in advance, announced to it (``AwaitOffers``).

A vLLM producer whose request said ``prefetch_by`` (the decode engine the proxy will send the decode request to)
posts the grant here once it is held; that engine, waiting in ``AwaitOffers``, hears of it at once and may pull
it before its own request for it arrives (``kpool_pd.vllm.prefetch``). Only engines that asked at least once
have a queue (a request naming any other engine posts nothing), each queue is bounded (the oldest announcement
goes first), an engine that stopped asking (``STALE_S``: a consumer that died) is forgotten with its queue at the
next announcement for it, and an announcement is only a hint: the grant is pulled, renewed and released as any other, and a
grant that ended before its pull is refused as any other.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_ANNOUNCED = 4096  # announcements waiting for one engine (the oldest is dropped beyond)
MAX_ENGINES = 1024  # engines with a queue (the one heard from longest ago is dropped beyond)
MAX_WAIT_S = 30.0  # the longest an AwaitOffers call waits
STALE_S = 2 * MAX_WAIT_S  # an engine that has not asked for this long is forgotten (its queue dropped)


@dataclass(frozen=True)
class Announcement:
    """A grant held for a named engine: its key and the ``kv_transfer_params`` its decode request carries (JSON)."""

    key: str
    params_json: str


class OfferBoard:
    """Per decode engine, the announcements it has not taken yet (used on the connector's event loop only)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._queues: dict[str, collections.deque[Announcement]] = {}
        self._ready: dict[str, asyncio.Event] = {}
        self._heard: dict[str, float] = {}  # engine -> when it last asked (monotonic)
        self.dropped = 0  # announcements dropped because an engine's queue was full

    def post(self, engine_id: str, announcement: Announcement) -> bool:
        """Announce ``announcement`` to ``engine_id``; False (nothing kept) when that engine never asked here, or
        not for ``STALE_S`` (it is forgotten then)."""
        queue = self._queues.get(engine_id)
        if queue is None:
            return False
        if self._clock() - self._heard[engine_id] > STALE_S:
            self._forget(engine_id)
            return False
        if len(queue) == queue.maxlen:
            self.dropped += 1
        queue.append(announcement)
        self._ready[engine_id].set()
        return True

    async def take(self, engine_id: str, wait_s: float) -> list[Announcement]:
        """Every announcement for ``engine_id`` not taken yet, waiting up to ``wait_s`` (at most ``MAX_WAIT_S``)
        for the first; the engine (authenticated by the caller) has a queue from its first call on."""
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise ValueError(f"wait_s must lie in [0, {MAX_WAIT_S}], got {wait_s}")
        self._open(engine_id)
        queue, ready = self._queues[engine_id], self._ready[engine_id]
        self._heard[engine_id] = self._clock()
        if not queue and wait_s > 0:
            try:
                await asyncio.wait_for(ready.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        self._heard[engine_id] = self._clock()
        taken = list(queue)
        queue.clear()
        ready.clear()
        return taken

    def _open(self, engine_id: str) -> None:
        if engine_id in self._queues:
            return
        if len(self._queues) >= MAX_ENGINES:  # forget the engine heard from longest ago
            self._forget(min(self._heard, key=self._heard.get))
        self._queues[engine_id] = collections.deque(maxlen=MAX_ANNOUNCED)
        self._ready[engine_id] = asyncio.Event()
        self._heard[engine_id] = self._clock()

    def _forget(self, engine_id: str) -> None:
        for table in (self._queues, self._ready, self._heard):
            table.pop(engine_id, None)

    def listening(self, engine_id: str) -> bool:
        """Whether ``engine_id`` has asked here (its announcements are kept)."""
        return engine_id in self._queues

    def waiting(self, engine_id: str) -> int:
        """The announcements ``engine_id`` has not taken (0 for an engine without a queue)."""
        return len(self._queues.get(engine_id, ()))
