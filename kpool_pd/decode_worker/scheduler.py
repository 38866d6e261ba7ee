"""Admission, fetching and continuous batching of the decode node.

* Admission: in arrival order, a request is allocated every block it will ever hold (prompt +
  output) and a ring from the node's cache, which the scheduler owns; at most ``max_queue`` wait
  for room (more get RESOURCE_EXHAUSTED) and a request larger than the whole pool is refused
  (INVALID_ARGUMENT).
* Fetching: Prefill on a prefill node picked by the router (another one is tried when a node
  is unavailable, busy or draining; with none usable the request fails at once, UNAVAILABLE with
  each node's reason), then one Pull that lands the prompt into the first blocks of the request's
  allocation (the connector never allocates), then the grant's Release. How a request is fetched and
  stepped (one node, or the ranks of a DCP instance) is the ``RequestFetch`` the daemon chose at start
  (``kpool_pd.decode_worker.fetch``); the scheduler asks it and never tells the two apart.
* Decoding: one loop runs a step for every running request at once on a thread of its own (finished
  requests are digested on a few others); the event loop keeps serving transfers meanwhile. A running
  request's blocks are freed by the loop only, between steps, so no step ever writes blocks that were
  handed to someone else.
  The loop reports to the request's handler through ``Job.events`` (``Tokens``, ``Failed``,
  ``Finished``).

Every exit path of a request (done, failed, cancelled by its client in any ``JobState``)
releases what it holds, through ``finish`` (idempotent), and leaves the prefill node no grant to
expire: a cancelled Prefill is cancelled on the node, a cancelled pull or Release gives the
grant back in the background (``PrefillPeer``). Cancellations are counted by the state they hit.

``on_room_change(has_room)`` (optional) hears when the node starts or stops refusing new requests
for room: every ring is taken and ``max_queue`` requests wait.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kpool_pd.connector import DecodeConnector, PrefillGrant, PrefillPeer, StatusError
from kpool_pd.decode_worker.fetch import RequestFetch
from kpool_pd.decode_worker.jobs import Failed, Finished, Job, JobState, Tokens
from kpool_pd.decode_worker.router import PrefillRouter
from kpool_pd.kvcache import NodeCache
from kpool_pd.model import DecodeSequence, Engine, mrope_delta, output_digest

logger = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
DIGEST_THREADS = 4  # finished requests digested at once, beside the steps


class DecodeScheduler:
    """Admission, fetching and the decode loop of one decode node; one event loop.

    ``GenerateService`` drives each request: ``submit``, ``wait_admitted``, ``fetch``,
    ``first_token_sent``, then ``start_decoding`` (or ``finish_unstarted``), and ``abandon``
    whatever the exit. The daemon runs ``run()`` as a task and drains until ``idle``."""

    def __init__(self, engine: Engine, cache: NodeCache, connector: DecodeConnector,
                 router: PrefillRouter, *, fetch: RequestFetch, max_running: int, max_queue: int,
                 queue_timeout_s: float, registry: CollectorRegistry,
                 on_room_change: Callable[[bool], None] | None = None) -> None:
        if cache.pool is not engine.pool:
            raise ValueError("the engine must compute on the pool of the cache the scheduler allocates from")
        self.engine, self.cache = engine, cache
        self.connector, self.router = connector, router
        self.max_running = min(max_running, cache.num_rings)
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.config = engine.config
        self.fetcher = fetch  # how a request is fetched and stepped: one node, or every rank of a DCP instance
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[str, Job] = {}
        self._running: list[Job] = []
        self._digests: set[asyncio.Task] = set()  # finished jobs being digested beside the steps
        # The steps run on a thread of their own and the digests on a few others, not on the event loop's default
        # executor: there a batch finishing at once queued its digests ahead of the next step.
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-step")
        self._digester = ThreadPoolExecutor(max_workers=DIGEST_THREADS, thread_name_prefix="state-digest")
        self._admitted = 0
        self._wake = asyncio.Event()
        self.steps_run, self.step_seconds_total, self.own_transfer_bytes = 0, 0.0, 0  # this rank's, for DCP metrics
        self.on_room_change = on_room_change
        self._had_room = True
        self.requests = Counter("kpoolpd_decode_requests", "Generate requests by outcome", ["outcome"], registry=registry)
        self.tokens = Counter("kpoolpd_decode_tokens", "Output tokens streamed", registry=registry)
        self.drafts = Counter("kpoolpd_decode_drafts", "Draft tokens by verdict", ["verdict"], registry=registry)
        self.cancelled = Counter("kpoolpd_decode_cancelled", "Requests cancelled by their client, by the state "
                                 "they were in", ["state"], registry=registry)
        self.ttft = Histogram("kpoolpd_decode_ttft_seconds", "Request arrival to first token",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=registry)
        self.step_seconds = Histogram("kpoolpd_decode_step_seconds", "One decode step of the whole batch",
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                      registry=registry)
        self.step_batch = Histogram("kpoolpd_decode_step_requests", "Requests in one decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=registry)
        Gauge("kpoolpd_decode_waiting", "Requests waiting for room", registry=registry).set_function(lambda: len(self._waiting))
        Gauge("kpoolpd_decode_running", "Requests in the decode batch", registry=registry).set_function(lambda: len(self._running))
        Gauge("kpoolpd_decode_reserved_blocks", "Blocks allocated to admitted requests",
              registry=registry).set_function(lambda: cache.num_blocks - cache.free_blocks)

    @property
    def idle(self) -> bool:
        return not self._active

    def active(self) -> int:
        return len(self._active)

    @property
    def has_room(self) -> bool:
        """False while a new request would be refused for room (every ring taken, the queue full)."""
        return self._admitted < self.max_running or len(self._waiting) < self.max_queue

    def _room_changed(self) -> None:
        room = self.has_room
        if room != self._had_room:
            self._had_room = room
            logger.info("decode node %s", "has room again" if room else
                        f"is full: {self._admitted} requests hold rings, {len(self._waiting)} wait")
            if self.on_room_change is not None:
                self.on_room_change(room)

    # admission ----------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: tuple[int, ...], max_tokens: int, *,
               mrope_positions: tuple[tuple[int, int, int], ...] = ()) -> Job:
        """Queue a validated request, with its checked MRoPE positions (() for text; raises StatusError when it
        cannot be queued)."""
        self.fetcher.check_usable()
        need = self.fetcher.blocks_for_request(len(prompt), max_tokens)
        if need > self.cache.num_blocks:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{len(prompt)} prompt + {max_tokens} output tokens need {need} blocks; "
                              f"this node has {self.cache.num_blocks}")
        if request_id in self._active:
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already in flight")
        if len(self._waiting) >= self.max_queue:  # the caller counts the refusal (kpoolpd_decode_requests_total)
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"decode queue is full ({len(self._waiting)} waiting, {len(self._running)} running)")
        job = Job(request_id=request_id, prompt=prompt, max_tokens=max_tokens, need_blocks=need,
                  admitted=asyncio.get_running_loop().create_future(), mrope_positions=mrope_positions)
        self._active[request_id] = job
        self._waiting.append(job)
        self._admit_ready()
        self._room_changed()
        return job

    def _admit_ready(self) -> None:
        while self._waiting:
            job = self._waiting[0]
            if self._admitted >= self.max_running or not self.cache.fits(job.need_blocks):
                return
            self._waiting.popleft()
            job.allocation = self.cache.allocate(job.request_id, job.need_blocks)
            self._admitted += 1
            job.state = JobState.PREFILLING
            job.admitted.set_result(None)

    async def wait_admitted(self, job: Job) -> None:
        """Until ``job`` has room. A request that fits waits as long as its call allows (the client's
        deadline cancels the wait), or ``queue_timeout_s`` where that is set (> 0): then DEADLINE_EXCEEDED.
        RESOURCE_EXHAUSTED is only ``submit``'s, at the queue's bound."""
        try:
            await asyncio.wait_for(asyncio.shield(job.admitted), self.queue_timeout_s or None)
        except asyncio.TimeoutError:
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no room in the decode batch within {self.queue_timeout_s} s "
                              f"(--queue-timeout-s)") from None

    # fetching -----------------------------------------------------------------------------
    async def fetch(self, job: Job) -> None:
        """Prefill remotely, pull into the job's allocation, release the grant, and set up the sequence
        (``job.state``: PREFILLING, PULLING, RELEASING). StatusError on failure; the caller then calls
        ``abandon``, which releases the allocation (the pull has retired every receive into it by then).
        Cancellation at any point leaves the prefill node no grant to expire."""
        peer, grant = await self._prefill(job)
        job.prefill_address, job.prefill_engine_id = peer.address, peer.engine_id
        job.state = JobState.PULLING
        try:
            transfer = await self.fetcher.pull(job, peer, grant)
        except StatusError as exc:
            if self.fetcher.skips_node(exc):  # handshake again before its next request (health follows the router)
                self.router.mark_failed(peer, exc.message)
            raise StatusError(exc.code, f"transfer from {peer.address} failed: {exc.message}") from None
        job.transfer_bytes, job.transfer_regions, job.transfer_ms = transfer.nbytes, transfer.regions, transfer.ms
        self.own_transfer_bytes += transfer.per_rank_bytes[0]
        job.seq = DecodeSequence(request_id=job.request_id, prompt_len=len(job.prompt), max_tokens=job.max_tokens,
                                 allocation=job.allocation, output=[job.landed.first_token],
                                 mrope_delta=mrope_delta(job.mrope_positions, len(job.prompt)))
        job.state = JobState.DECODING

    async def _prefill(self, job: Job) -> tuple[PrefillPeer, PrefillGrant]:
        """A grant for the job's prompt, from the first node that gives one: a node that is
        unavailable, full or draining is retried on another (one try more than healthy nodes, at
        least two). StatusError with the last node's status, or the router's (no node usable)."""
        # One more try than healthy nodes: when every node failed its call (they all went down at once), the last
        # pick waits up to the router's no_node_wait_s for one to come back instead of failing the request.
        attempts = max(2, len(self.router.healthy()) + 1)
        last: StatusError | None = None
        for _ in range(attempts):
            peer = await self.router.pick(len(job.prompt))  # UNAVAILABLE, with each node's reason, when none is usable
            try:
                return peer, await self.fetcher.prefill(peer, job)
            except StatusError as exc:
                last = exc
                if exc.code not in RETRYABLE:
                    raise StatusError(exc.code, exc.message) from None
                if exc.code is grpc.StatusCode.UNAVAILABLE or (self.fetcher.pushes_to(peer) and self.fetcher.skips_node(exc)):
                    self.router.mark_failed(peer, exc.message)  # a push that failed as a pull takes the node out too
                logger.info("prefill of %s failed (%s); trying another node", job.request_id, exc,
                            extra={"request_id": job.request_id})
        raise StatusError(last.code, last.message)

    def first_token_sent(self, job: Job) -> None:
        job.ttft_ms = job.elapsed_ms()
        self.ttft.observe(job.ttft_ms / 1000)
        self.tokens.inc()

    def start_decoding(self, job: Job) -> None:
        """Hand a fetched job to the decode loop (which then owns its blocks)."""
        self._running.append(job)
        self._wake.set()

    # decoding -----------------------------------------------------------------------------
    def _step(self, jobs: list[Job]) -> tuple[list[list[int]], dict[int, str], float]:
        """Worker thread: one step for the batch; where the fetch digests in the step (DCP: a collective, which
        the ranks run in the decode loop's order) also the state digest of each finished job. Otherwise the loop
        digests finished jobs beside the next steps (``_digest_and_finish``)."""
        started = time.perf_counter()
        emitted = self.engine.decode_step([j.seq for j in jobs])
        seconds = time.perf_counter() - started
        digests = {id(j): self._digest(j) for j in jobs if j.seq.finished} if self.fetcher.digests_in_step else {}
        return emitted, digests, seconds

    def _digest(self, job: Job) -> str:
        return self.engine.state_digest(job.seq.block_ids, job.seq.ring_id, job.seq.cached)

    async def _digest_and_finish(self, job: Job) -> None:
        """A finished job's state digest on a worker thread (it reads only the job's blocks and ring, which it holds
        until then), then its Finished event and its release; the decode loop steps on meanwhile."""
        try:
            digest = await asyncio.get_running_loop().run_in_executor(self._digester, self._digest, job)
        except Exception as exc:
            logger.exception("state digest of request %s failed", job.request_id)
            job.events.put_nowait(Failed(StatusError(grpc.StatusCode.INTERNAL, f"state digest failed: {exc}")))
            self.finish(job, "error")
            return
        self._report_finished(job, digest)

    def _report_finished(self, job: Job, digest: str) -> None:
        self.drafts.labels("accepted").inc(job.seq.drafts_accepted)
        self.drafts.labels("rejected").inc(job.seq.drafts_proposed - job.seq.drafts_accepted)
        job.events.put_nowait(self._finished_event(job, digest))
        self.finish(job, "ok")

    def _finished_event(self, job: Job, state_digest: str) -> Finished:
        seq = job.seq
        return Finished(output_digest=output_digest(seq.output), state_digest=state_digest, num_tokens=len(seq.output),
                        steps=seq.steps, drafts_proposed=seq.drafts_proposed, drafts_accepted=seq.drafts_accepted,
                        ttft_ms=job.ttft_ms, total_ms=job.elapsed_ms())

    async def finish_unstarted(self, job: Job) -> None:
        """A fetched job that needs no step (max_tokens == 1): its digest, then done. Where the fetch digests in
        the step (DCP: a collective, and every collective of the ranks runs in one order, the decode loop's) the
        loop's next step digests the job (a finished sequence takes no step)."""
        if self.fetcher.digests_in_step:
            self.start_decoding(job)
            return
        digest = await asyncio.get_running_loop().run_in_executor(self._digester, self._digest, job)
        job.events.put_nowait(self._finished_event(job, digest))

    async def run(self) -> None:
        """The decode loop (a task the daemon owns)."""
        while True:
            for job in [j for j in self._running if j.cancelled]:
                self._running.remove(job)
                self.finish(job, "cancelled")
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._running)
            try:
                step = asyncio.get_running_loop().run_in_executor(self._stepper, self._step, batch)
                emitted, digests, seconds = await self.fetcher.step(step, [j.request_id for j in batch])
            except Exception as exc:
                logger.exception("decode step of %d requests failed", len(batch))
                error = exc if isinstance(exc, StatusError) else StatusError(grpc.StatusCode.INTERNAL,
                                                                             "decode step failed")
                for job in batch:
                    self._running.remove(job)
                    job.events.put_nowait(Failed(error))
                    self.finish(job, "error")
                continue
            self.step_seconds.observe(seconds)
            self.steps_run += 1
            self.step_seconds_total += seconds
            self.step_batch.observe(len(batch))
            for job, tokens in zip(batch, emitted):
                if tokens:
                    self.tokens.inc(len(tokens))
                    job.events.put_nowait(Tokens(tuple(tokens)))
                if id(job) in digests:
                    self._running.remove(job)
                    self._report_finished(job, digests[id(job)])
                elif job.seq.finished:
                    self._running.remove(job)
                    digesting = asyncio.create_task(self._digest_and_finish(job), name=f"digest-{job.request_id}")
                    self._digests.add(digesting)
                    digesting.add_done_callback(self._digests.discard)

    def close(self) -> None:
        """Stop the step and digest threads once their work in hand is done (call after the decode loop ended)."""
        self._stepper.shutdown(wait=False, cancel_futures=True)
        self._digester.shutdown(wait=False, cancel_futures=True)

    # release ------------------------------------------------------------------------------
    def abandon(self, job: Job, outcome: str) -> None:
        """The request's handler is leaving (done, failed or cancelled). A job in the running
        batch is handed back to the decode loop, which frees it between steps."""
        if job.state is JobState.DECODING and job in self._running:
            job.cancelled = True
            self._wake.set()
            return
        self.finish(job, outcome)

    def finish(self, job: Job, outcome: str) -> None:
        """Release the job's allocation (its blocks and ring), count its outcome, and admit who waits
        (idempotent)."""
        if job.state is JobState.DONE:
            return
        if outcome == "cancelled":
            self.cancelled.labels(job.state.value).inc()
        job.state = JobState.DONE
        if job in self._waiting:
            self._waiting.remove(job)
        if job.landed is not None:
            self.fetcher.drop(job.request_id)  # DCP: the other ranks free it too (those that finished it hold nothing)
        if job.allocation is not None:
            job.allocation.release()
            self._admitted -= 1
        if not job.admitted.done():
            job.admitted.cancel()
        self._active.pop(job.request_id, None)
        self.requests.labels(outcome).inc()
        logger.info("request %s %s", job.request_id, outcome,
                    extra={"request_id": job.request_id, "outcome": outcome, "ms": round(job.elapsed_ms(), 1),
                           "tokens": len(job.seq.output) if job.seq else 0})
        self._admit_ready()
        self._room_changed()
