"""The prefill node's engine for the connector: validates, allocates, and batches prefills.

Prefill calls that arrive while a batch runs wait in a bounded queue and run together in the
next batch (one launch per layer for the whole batch), in one worker thread so the event loop
keeps serving pulls, releases and heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector import CacheExhaustedError, EngineUnavailable, PrefillCache, PrefillInput, PrefillOutput
from model import Engine, PrefillJob

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Queued:
    job: PrefillJob
    request_id: str
    future: asyncio.Future


class BatchingPrefillEngine:
    """Implements ``connector.PrefillEngine``. ``run()`` is the batch loop (a task the
    daemon owns); ``draining = True`` refuses new prefills with UNAVAILABLE (``EngineUnavailable``),
    so that decode nodes try another prefill node."""

    def __init__(self, engine: Engine, *, max_batch_tokens: int, max_queue: int, registry: CollectorRegistry) -> None:
        if max_batch_tokens <= 0 or max_queue <= 0:
            raise ValueError(f"max_batch_tokens and max_queue must be > 0, got {max_batch_tokens}, {max_queue}")
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.draining = False
        self._pending: list[_Queued] = []
        self._wake = asyncio.Event()
        self._busy = False
        self.requests = Counter("kpoolpd_prefill_requests", "Prefill calls by outcome", ["outcome"], registry=registry)
        self.batch_tokens = Histogram("kpoolpd_prefill_batch_tokens", "Prompt tokens per prefill batch",
                                      buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=registry)
        self.batch_seconds = Histogram("kpoolpd_prefill_batch_seconds", "Time of one prefill batch", registry=registry)
        Gauge("kpoolpd_prefill_queue", "Prefill calls waiting for a batch", registry=registry).set_function(
            lambda: len(self._pending))

    @property
    def idle(self) -> bool:
        return not self._pending and not self._busy

    async def prefill(self, request: PrefillInput, cache: PrefillCache) -> PrefillOutput:
        config = self.engine.config
        prompt = request.prompt_token_ids
        if self.draining:
            self.requests.labels("draining").inc()
            raise EngineUnavailable("prefill node is draining; try another")
        bad = [t for t in prompt if t >= config.vocab_size]
        if bad:
            self.requests.labels("invalid").inc()
            raise ValueError(f"prompt token ids must be < vocab_size {config.vocab_size}, got {bad[:5]}")
        if len(self._pending) >= self.max_queue:
            self.requests.labels("queue_full").inc()
            raise CacheExhaustedError(f"prefill queue is full ({len(self._pending)} waiting)")
        block_ids, ring_id = cache.allocate(self.engine.pool.config.blocks_for_tokens(len(prompt)))
        queued = _Queued(PrefillJob(prompt=prompt, block_ids=block_ids, ring_id=ring_id), request.request_id,
                         asyncio.get_running_loop().create_future())
        self._pending.append(queued)
        self._wake.set()
        try:
            first = await asyncio.shield(queued.future)
        except asyncio.CancelledError:
            # The caller gave up: free the blocks now if they were never written, else once the
            # batch that writes them has finished.
            if queued in self._pending:
                self._pending.remove(queued)
                cache.rollback()
            else:
                queued.future.add_done_callback(lambda _: cache.rollback())
            self.requests.labels("cancelled").inc()
            raise
        self.requests.labels("ok").inc()
        return PrefillOutput(block_ids=block_ids, ring_id=ring_id, prompt_len=len(prompt), first_token=first)

    def _take_batch(self) -> list[_Queued]:
        batch, tokens = [], 0
        while self._pending and (not batch or tokens + len(self._pending[0].job.prompt) <= self.max_batch_tokens):
            queued = self._pending.pop(0)
            batch.append(queued)
            tokens += len(queued.job.prompt)
        return batch

    async def run(self) -> None:
        """Run batches until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = self._take_batch()
                self._busy = True
                started = time.perf_counter()
                try:
                    firsts = await asyncio.to_thread(self.engine.prefill, [q.job for q in batch])
                except Exception as exc:  # every waiter gets the error; the connector frees
                    logger.exception("prefill batch of %d requests failed", len(batch))
                    for q in batch:
                        if not q.future.done():
                            q.future.set_exception(exc)
                    continue
                finally:
                    self._busy = False
                self.batch_seconds.observe(time.perf_counter() - started)
                self.batch_tokens.observe(sum(len(q.job.prompt) for q in batch))
                logger.debug("prefilled %d requests in %.1f ms", len(batch), (time.perf_counter() - started) * 1000)
                for q, first in zip(batch, firsts):
                    if not q.future.done():
                        q.future.set_result(first)
