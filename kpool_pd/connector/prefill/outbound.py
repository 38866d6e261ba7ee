"""The prefill side of one Pull stream: the grant's regions sent over UCX or the gRPC stream, each as soon
as the prompt's chunks have written it (a pipelined grant), then PullDone.

``OutboundPull.messages()`` is the stream the Pull RPC yields. Region i may move once ``plan.ready[i]``
prompt tokens are written in every layer (``kpool_pd.connector.prefill.served_plan``): a grant made after its prompt
was computed sends everything at once, as before; a pipelined grant sends each piece of blocks while
later chunks compute, announces the prompt's end (PrefillDone, with the first token) as soon as the
last chunk is computed, then moves the remaining pieces and the ring. Every wait has the Pull's
deadline; a prefill that fails, a deadline passed, or a failed UCX send aborts the stream with a
status (``PullAborted``), and the caller's cleanup stops the sends still in flight. The UCX sends go
on an endpoint lent to this pull alone, so that stopping them stops no other pull's to the same engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import torch

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.leases import Grant
from kpool_pd.connector.prefill.served_plan import ServedPlan
from kpool_pd.connector.shared import hops, pull_frames, regions
from kpool_pd.connector.prefill.ucx_link import LentEndpoint, UcxLink
from kpool_pd.connector.shared.ucx import UcxSendError, region_tag
from kpool_pd.connector.shared.wire import Transport

logger = logging.getLogger(__name__)


class PullAborted(Exception):
    """The Pull must end with ``code`` and ``message`` (the RPC handler aborts with them)."""

    def __init__(self, code: grpc.StatusCode, message: str, cause: str) -> None:
        super().__init__(message)
        self.code, self.message, self.cause = code, message, cause


class SendClock:
    """When regions were being sent: ``spans`` holds (region, start, end) in perf_counter seconds, ``running``
    the starts of sends posted and not completed; ``busy_ms`` is the union of the spans' intervals."""

    __slots__ = ("spans", "running")

    def __init__(self) -> None:
        self.spans: list[tuple[int, float, float]] = []
        self.running: dict[int, float] = {}  # region -> its send's start

    def start(self, region: int, start: float) -> None:
        self.running[region] = start

    def add(self, region: int, start: float, end: float) -> None:
        self.running.pop(region, None)
        self.spans.append((region, start, end))

    @property
    def _spans(self) -> list[tuple[float, float]]:
        return [(start, end) for _, start, end in self.spans]

    def after_ms(self, moment: float) -> float:
        """From ``moment`` (perf_counter) to the last send's end, 0 if none ended later."""
        return max([0.0] + [(end - moment) * 1000 for _, end in self._spans])

    @staticmethod
    def _union_ms(intervals: list[tuple[float, float]]) -> float:
        total, reach = 0.0, float("-inf")
        for start, end in sorted(intervals):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total * 1000

    @property
    def busy_ms(self) -> float:
        return self._union_ms(self._spans)

    def busy_until_ms(self, now: float) -> float:
        """How long regions have been sent by ``now``: the spans, and each send still running from its start."""
        return self._union_ms(self._spans + [(start, now) for start in self.running.values()])

    def exposed_ms(self, written: float, now: float) -> float:
        """What the sends exposed after the prompt's last chunk was ``written``, as seen ``now``: up to the last
        send's end once every send started has completed, else up to now (0 if neither came later)."""
        end = now if self.running else max([written] + [end for _, end in self._spans])
        return max(0.0, (end - written) * 1000)


class OutboundPull:
    """One Pull of ``grant``, used once. ``sends`` are the UCX sends started, on ``endpoint`` (lent to
    this pull by ``link``, the engine's); the caller's ``stop_sends`` ends them and the loan when the
    stream ends."""

    def __init__(self, grant: Grant, plan: ServedPlan, views: Sequence[torch.Tensor | Callable[[], torch.Tensor]], *,
                 transport: Transport, engine_id: str, link: UcxLink | None, tag_base: int, chunk_bytes: int,
                 integrity: bool, deadline: float) -> None:
        self.grant, self.plan, self.views, self.ready = grant, plan, list(views), plan.ready
        self.transport, self.engine_id, self.link, self.tag_base = transport, engine_id, link, tag_base
        self.chunk_bytes, self.integrity, self.deadline = chunk_bytes, integrity, deadline
        self.sends: list[asyncio.Future] = []
        self.endpoint: LentEndpoint | None = None
        self.clock = SendClock()
        self._announced = grant.prefill is None  # a grant made after its prompt has nothing to announce
        self._begun = False  # UCX: ``begin`` ran
        self._next = 0  # UCX: the first region whose send is not posted yet
        self._failure: PullAborted | None = None  # a send that ``_on_advance`` could not post
        self._woken = asyncio.Event()  # set with ``_failure``

    def _view(self, index: int) -> torch.Tensor:
        """Region ``index``'s bytes: its view of the pool, or (a push's region over blocks that do not lie
        together) their copy, gathered once the region may move and kept for the rest of the pull."""
        view = self.views[index]
        if callable(view):
            view = self.views[index] = view()
        return view

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def _prefill_outcome(self) -> None:
        """Raise PullAborted when the grant's computation failed (or was stopped)."""
        task = self.grant.prefill
        if task is None or not task.done():
            return
        if task.cancelled() or task.exception() is not None:
            why = self.grant.failure or ("cancelled" if task.cancelled() else str(task.exception()))
            raise PullAborted(grpc.StatusCode.INTERNAL, f"prefill of {self.grant.request_id} failed: {why}", "engine")

    async def _until_written(self, tokens: int) -> None:
        """Until ``tokens`` prompt tokens are written (or the computation ended: the prompt is then whole)."""
        progress, task = self.grant.progress, self.grant.prefill
        if task is None or progress.prefilled >= tokens:
            return
        waiter = asyncio.ensure_future(progress.wait_prefilled(tokens))
        try:
            await asyncio.wait({waiter, task}, timeout=max(self._left(), 0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        self._prefill_outcome()
        if progress.prefilled < tokens and not task.done():
            raise PullAborted(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {self.grant.request_id} did not reach "
                              f"token {tokens} before the Pull's deadline", "deadline")

    async def _until_computed(self) -> None:
        """Until the grant's computation returned (its first token known); PullAborted if it failed."""
        task = self.grant.prefill
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=max(self._left(), 0))
            if not task.done():
                raise PullAborted(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {self.grant.request_id} did not end "
                                  "before the Pull's deadline", "deadline")
        self._prefill_outcome()

    def _announcement(self) -> pb.PullResponse | None:
        """PrefillDone, once, as soon as the grant's computation ended well."""
        if self._announced or not self.grant.prefill.done():
            return None
        self._prefill_outcome()
        self._announced = True
        out, prefill_ms, _ = self.grant.prefill.result()  # its done-callback may not have run yet
        done = pb.PrefillDone(first_token=out.first_token, prefill_ms=prefill_ms)
        if written := self._prompt_written_at():  # the decode node's anchor for what the transfer exposes
            now = time.perf_counter()
            done.after_prompt_ms, done.sent_ms = self.clock.exposed_ms(written, now), self.clock.busy_until_ms(now)
        hops.stamp(self.grant.grant_id, "announced")
        return pb.PullResponse(prefilled=done)

    def _post(self, index: int) -> None:
        """Post region ``index``'s send now (UCX has it when this returns); the clock notes when it completed."""
        started = time.perf_counter()
        hops.stamp(self.grant.grant_id, "send")
        try:
            sent = self.endpoint.post(self._view(index), region_tag(self.tag_base, index))
        except UcxSendError as exc:  # the decode node reset the connection or went away
            raise PullAborted(grpc.StatusCode.UNAVAILABLE, str(exc), "ucx_send") from None
        self.clock.start(index, started)
        sent.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                               else self._completed(index, started))
        self.sends.append(sent)

    def _completed(self, index: int, started: float) -> None:
        """Region ``index``'s send (posted at ``started``) completed: the clock notes it (and the hop stamps the
        last send's completion)."""
        self.clock.add(index, started, time.perf_counter())
        if not self.clock.running and self._next == len(self.views):
            hops.stamp(self.grant.grant_id, "completed")

    def _start_ready_sends(self, index: int) -> int:
        """UCX: post the sends of regions ``index``, ``index + 1``, ... that may move now; the next one not posted."""
        self._prefill_outcome()
        progress = self.grant.progress
        if progress.prefilled >= self.grant.prompt_len and progress.written_at:  # when the engine said so
            hops.stamp(self.grant.grant_id, "prompt", progress.written_at)
        while index < len(self.views) and (not self.grant.computing or progress.prefilled >= self.ready[index]):
            self._post(index)
            index += 1
        return index

    def _on_advance(self) -> None:
        """Listener of the grant's progress (``PrefillProgress.listen``): the engine has just written more of the
        prompt, and the sends it made ready are posted within its call, with no loop step in between. A failure
        is kept for ``messages`` (and wakes it)."""
        if self._failure is not None:
            return
        try:
            self._next = self._start_ready_sends(self._next)
        except PullAborted as exc:
            self._failure = exc
            self._woken.set()

    async def _push_as_written(self) -> None:
        """UCX, a grant still computing: its sends are posted from the engine's ``advance`` as the chunks write
        them (``_on_advance``), until the computation ended; PullAborted if it failed, a send could not be
        posted, or the deadline passed first."""
        task, progress = self.grant.prefill, self.grant.progress
        progress.listen(self._on_advance)
        woken = asyncio.ensure_future(self._woken.wait())
        try:
            self._on_advance()  # what the engine wrote before the listener was in place
            if self._failure is None and not task.done():
                await asyncio.wait({task, woken}, timeout=max(self._left(), 0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            progress.unlisten(self._on_advance)
            woken.cancel()
        if self._failure is not None:
            raise self._failure
        if not task.done():
            raise PullAborted(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {self.grant.request_id} did not end "
                              "before the Pull's deadline", "deadline")
        self._prefill_outcome()

    async def begin(self) -> None:
        """UCX: lend this pull its endpoint and post the sends that may move now (``messages`` does it first
        thing, unless it was done before: a push does it before its first message leaves). Idempotent;
        PullAborted for a failed prompt or an endpoint that cannot be lent."""
        if self.transport is not Transport.UCX or self._begun:
            return
        self._begun = True
        self._prefill_outcome()
        try:
            self.endpoint = await self.link.lend()
        except UcxSendError as exc:  # the engine was forgotten, or handshook anew, since the pull began
            raise PullAborted(grpc.StatusCode.UNAVAILABLE, str(exc), "ucx_send") from None
        hops.stamp(self.grant.grant_id, "lent")
        self._next = self._start_ready_sends(0)

    async def messages(self) -> AsyncIterator[pb.PullResponse | bytes]:
        grant, plan = self.grant, self.plan
        self._prefill_outcome()
        index = 0
        if self.transport is Transport.UCX:  # the decode node posted its receives before its pull request left
            await self.begin()
            if self._next < len(self.views):
                await self._push_as_written()
            index = self._next = self._start_ready_sends(self._next)  # the prompt is whole
        while index < len(self.views):  # the gRPC stream: each region's chunks once the prompt has written it
            await self._until_written(self.ready[index])
            if (note := self._announcement()) is not None:
                yield note
            view, started = self._view(index), time.perf_counter()
            self.clock.start(index, started)
            for off in range(0, view.numel(), self.chunk_bytes):
                yield pull_frames.encode_chunk(index, off, regions.host_bytes(view[off:off + self.chunk_bytes]))
                if (note := self._announcement()) is not None:
                    yield note
            self.clock.add(index, started, time.perf_counter())
            index += 1
        await self._until_computed()  # every token may be written before the computation has returned
        if (note := self._announcement()) is not None:
            yield note
        if self.sends:
            all_sent = asyncio.gather(*self.sends)
            all_sent.add_done_callback(_retrieved)  # its outcome is read here, or nowhere once the pull ended
            try:
                await asyncio.wait_for(asyncio.shield(all_sent), max(self._left(), 0))
                hops.stamp(grant.grant_id, "sent")
            except asyncio.TimeoutError:
                raise PullAborted(grpc.StatusCode.DEADLINE_EXCEEDED, f"UCX sends to {self.engine_id} did not complete "
                                  "before the Pull's deadline", "deadline") from None
            except UcxSendError as exc:  # the decode node reset the connection or went away
                logger.warning("pull of grant %s by engine %s: %s", grant.grant_id, self.engine_id, exc)
                raise PullAborted(grpc.StatusCode.UNAVAILABLE, str(exc), "ucx_send") from None
        checksums = [regions.crc32(self._view(i)) for i in range(len(self.views))] if self.integrity else []
        after = self.clock.after_ms(self._prompt_written_at()) if self._prompt_written_at() else 0.0
        yield pb.PullResponse(done=pb.PullDone(bytes=plan.total_bytes, regions=len(plan), crc32=checksums,
                                               send_ms=self.clock.busy_ms, sent_after_prefill_ms=after))

    def _prompt_written_at(self) -> float:
        """When (perf_counter) the prompt's last chunk was written: the engine's ``advance`` to the prompt's
        length, or the computation's end if that came first; 0 for a grant this node's engine offered (no
        Prefill or push made it: nothing here knows when its prompt ended)."""
        grant, progress = self.grant, self.grant.progress
        ended = grant.prefill.result()[2] if grant.prefill is not None else grant.computed_at
        if not ended:
            return 0.0
        written = progress.written_at if progress.prefilled >= grant.prompt_len else 0.0
        return min(ended, written) if written else ended

    def stop_sends(self) -> bool:
        """The stream ended: stop every send not done (at once, no await: abort the endpoint lent to this
        pull, which cancels them and no other pull's, so that no send reads the grant's blocks any more),
        else give the endpoint back for a later pull. True if some were running. Idempotent."""
        running = [s for s in self.sends if not s.done()]
        if self.endpoint is not None:
            if running:
                self.endpoint.abort(reason="its pull ended before the sends completed")
            self.endpoint.give_back()  # after an abort: nothing to give back
        for send in self.sends:
            send.cancel()
            send.add_done_callback(_retrieved)
        return bool(running)


def _retrieved(task: asyncio.Future) -> None:
    """Done-callback: retrieve a task's outcome (its pull has ended and answered already)."""
    if not task.cancelled():
        task.exception()
