"""The prefill node's engine for the connector: validates, allocates from the node's cache (which it
owns: the connector only serves the allocations it is handed), and schedules prefills by a token budget.

Each step runs one forward of at most ``max_batch_tokens`` prompt tokens (one launch per layer for
the whole step), in one worker thread so the event loop keeps serving pulls, releases and
heartbeats. Requests are served in arrival order: the oldest unfinished prompt gets its next chunk
first, then the next ones fill what is left of the budget, so a long prompt is split across steps
and many short prompts share one. Chunks start and end anywhere (the engine carries the open pool
or group in the ring). After each step a request's ``PrefillProgress.advance`` says how many of its
tokens are written in every layer, so that the connector can move the blocks those complete while
later chunks compute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kpool_pd.connector import CacheExhaustedError, EngineUnavailable, PrefillInput, PrefillOutput, PrefillProgress
from kpool_pd.kvcache import CacheAllocation, NodeCache
from kpool_pd.model import Engine, PrefillJob, check_mrope_positions, check_prompt, mrope_from_flat

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Queued:
    """A request in the schedule: its prompt (and its MRoPE positions, () for text), where its blocks are, how far it
    got."""

    prompt: tuple[int, ...]
    allocation: CacheAllocation
    progress: PrefillProgress
    request_id: str
    future: asyncio.Future
    mrope_positions: tuple[tuple[int, int, int], ...] = ()
    done: int = 0  # prompt tokens prefilled so far
    running: bool = False  # a chunk of it is in the step now running
    abandoned: bool = False  # its caller left while a chunk ran: roll back once the step ends

    def chunk(self, budget: int) -> PrefillJob:
        end = min(len(self.prompt), self.done + budget)
        return PrefillJob(prompt=self.prompt, block_ids=self.allocation.block_ids, ring_id=self.allocation.ring_id,
                          start=self.done, end=end, mrope_positions=self.mrope_positions)


class BatchingPrefillEngine:
    """Implements ``connector.PrefillEngine``. ``run()`` is the batch loop (a task the
    daemon owns); ``draining = True`` refuses new prefills with UNAVAILABLE (``EngineUnavailable``),
    so that decode nodes try another prefill node."""

    def __init__(self, engine: Engine, cache: NodeCache, *, max_batch_tokens: int, max_queue: int,
                 registry: CollectorRegistry) -> None:
        if max_batch_tokens <= 0 or max_queue <= 0:
            raise ValueError(f"max_batch_tokens and max_queue must be > 0, got {max_batch_tokens}, {max_queue}")
        if cache.pool is not engine.pool:
            raise ValueError("the engine must compute on the pool of the cache the batcher allocates from")
        self.engine = engine
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.draining = False
        self._pending: list[_Queued] = []
        self._wake = asyncio.Event()
        self._busy = False
        self.requests = Counter("kpoolpd_prefill_requests", "Prefill calls by outcome", ["outcome"], registry=registry)
        self.batch_tokens = Histogram("kpoolpd_prefill_batch_tokens", "Prompt tokens per prefill step",
                                      buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=registry)
        self.batch_seconds = Histogram("kpoolpd_prefill_batch_seconds", "Time of one prefill step", registry=registry)
        self.chunks = Counter("kpoolpd_prefill_chunks", "Prompt chunks prefilled (a prompt split across steps "
                              "counts once per step)", registry=registry)
        Gauge("kpoolpd_prefill_queue", "Prefill calls not finished (waiting, or between chunks)",
              registry=registry).set_function(lambda: len(self._pending))

    @property
    def idle(self) -> bool:
        return not self._pending and not self._busy

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens admitted and not yet computed (the chunks of the step now running included)."""
        return sum(len(q.prompt) - q.done for q in self._pending)

    @property
    def steps_running(self) -> int:
        """Prefill steps running now (this engine runs one at a time)."""
        return int(self._busy)

    async def prefill(self, request: PrefillInput, progress: PrefillProgress) -> PrefillOutput:
        config = self.engine.config
        prompt = request.prompt_token_ids
        if self.draining:
            self.requests.labels("draining").inc()
            raise EngineUnavailable("prefill node is draining; try another")
        try:
            prompt = check_prompt(prompt, vocab_size=config.vocab_size)  # its length: the connector's limit
            positions = check_mrope_positions(mrope_from_flat(request.mrope_positions, prompt_len=len(prompt)),
                                              prompt_len=len(prompt), cache=config.cache)
        except ValueError:
            self.requests.labels("invalid").inc()
            raise
        if len(self._pending) >= self.max_queue:
            self.requests.labels("queue_full").inc()
            raise CacheExhaustedError(f"prefill queue is full ({len(self._pending)} waiting)")
        allocation = self.cache.allocate(request.request_id, self.cache.config.blocks_for_tokens(len(prompt)))
        progress.serve_from(allocation)  # the grant's from now on: the connector releases it when the grant ends
        queued = _Queued(tuple(prompt), allocation, progress, request.request_id,
                         asyncio.get_running_loop().create_future(), mrope_positions=positions)
        self._pending.append(queued)
        self._wake.set()
        try:
            first = await asyncio.shield(queued.future)
        except asyncio.CancelledError:
            # The caller gave up: free the blocks now if no chunk of it is running, else once the step
            # that writes them has ended.
            if queued.running:
                queued.abandoned = True
            else:
                if queued in self._pending:
                    self._pending.remove(queued)
                allocation.release()
            self.requests.labels("cancelled").inc()
            raise
        self.requests.labels("ok").inc()
        return PrefillOutput(prompt_len=len(prompt), first_token=first)

    def _take_step(self) -> list[tuple[_Queued, PrefillJob]]:
        """The next step's chunks: the oldest unfinished prompts first, up to ``max_batch_tokens``."""
        step, left = [], self.max_batch_tokens
        for queued in self._pending:
            if left == 0:
                break
            job = queued.chunk(left)
            step.append((queued, job))
            left -= job.num_tokens
        return step

    async def run(self) -> None:
        """Run steps until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._run_step(self._take_step())

    async def _run_step(self, step: list[tuple[_Queued, PrefillJob]]) -> None:
        for queued, _ in step:
            queued.running = True
        self._busy = True
        started = time.perf_counter()
        try:
            firsts = await asyncio.to_thread(self.engine.prefill, [job for _, job in step])
        except Exception as exc:  # every request of the step fails; the connector frees
            logger.exception("prefill step of %d chunks failed", len(step))
            for queued, _ in step:
                self._pending.remove(queued)
                if queued.abandoned:
                    queued.allocation.release()
                elif not queued.future.done():
                    queued.future.set_exception(exc)
            return
        finally:
            self._busy = False
            for queued, _ in step:
                queued.running = False
        seconds = time.perf_counter() - started
        self.batch_seconds.observe(seconds)
        self.batch_tokens.observe(sum(job.num_tokens for _, job in step))
        self.chunks.inc(len(step))
        logger.debug("prefilled %d chunks (%d tokens) in %.1f ms", len(step), sum(j.num_tokens for _, j in step),
                     seconds * 1000)
        for (queued, job), first in zip(step, firsts):
            if queued.abandoned:
                if queued in self._pending:
                    self._pending.remove(queued)
                queued.allocation.release()
                continue
            queued.done = job.stop
            queued.progress.advance(job.stop)
            if job.last:
                self._pending.remove(queued)
                if not queued.future.done():
                    queued.future.set_result(first)
