"""The Prefill RPC on the prefill node: a handshaken decode engine's prompt run through the engine and held
as a grant under lease (``kpool_pd.connector.prefill.grants``).

The engine allocates and hands the allocation to the call's ``PrefillProgress`` (``serve_from``); from
then on the grant holds that handle. A pipelined call is answered once the engine allocated, its
computation going on behind (the Pull moves the blocks as the chunks complete them); otherwise once the
prompt is computed. Every exit without a grant (a refusal, the engine's failure, the caller cancelling)
stops the computation and releases the allocation. The engine's exceptions become statuses through
``kpool_pd.connector.shared.errors.status_of``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.decode_engines import MAX_ID_CHARS, DecodeEngineTable
from kpool_pd.connector.prefill.engine import PrefillEngine, PrefillInput, PrefillOutput, PrefillProgress
from kpool_pd.connector.prefill.grants import GrantKeeper
from kpool_pd.connector.prefill.leases import Grant
from kpool_pd.connector.shared.config import ConnectorConfig
from kpool_pd.connector.shared.errors import StatusError, status_of
from kpool_pd.connector.shared.metrics import ConnectorMetrics
from kpool_pd.connector.shared.plan import ring_live_range
from kpool_pd.connector.shared.wire import ring_message
from kpool_pd.kvcache import BlockLayout, DcpConfig

logger = logging.getLogger(__name__)

MAX_DCP_RANKS = 64

_CAUSES = {grpc.StatusCode.RESOURCE_EXHAUSTED: "cache_exhausted", grpc.StatusCode.UNAVAILABLE: "engine_unavailable",
           grpc.StatusCode.INVALID_ARGUMENT: "engine_refused"}  # metric causes of the engine's failures


class PrefillDesk:
    """Answers Prefill calls of the engines in ``engines`` with grants kept by ``grants``."""

    def __init__(self, *, engine_id: str, layout: BlockLayout, engine: PrefillEngine, config: ConnectorConfig,
                 engines: DecodeEngineTable, grants: GrantKeeper, metrics: ConnectorMetrics) -> None:
        self.engine_id, self.layout, self.engine, self.config = engine_id, layout, engine, config
        self.engines, self.grants, self.metrics = engines, grants, metrics

    def _check(self, request: pb.PrefillRequest) -> None:
        """StatusError for a call that must not reach the engine."""
        n = len(request.prompt_token_ids)
        if not request.request_id or len(request.request_id) > MAX_ID_CHARS:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id must have 1 to {MAX_ID_CHARS} characters")
        if not 1 <= n <= self.config.max_prompt_tokens:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"prompt has {n} tokens; must have 1 to {self.config.max_prompt_tokens}")
        self.grants.authenticate(request.engine_id, request.engine_secret, "Prefill")
        self.engines.heard_from(request.engine_id)
        if len(self.grants) >= self.config.max_grants:
            self.metrics.failures.labels("too_many_grants").inc()
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{len(self.grants)} grants held (limit {self.config.max_grants})")
        if request.dcp_engine_ids:
            problem = self._dcp_problem(request.engine_id, tuple(request.dcp_engine_ids), request.dcp_interleave)
            if problem:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, problem)

    def _supersede(self, request: pb.PrefillRequest) -> None:
        """A Prefill of a request whose engine already holds a grant for it means the engine never got that
        answer (its call ended, e.g. at its deadline on a loaded node, just as the grant was made), so
        nothing will pull or release that grant: it is released now and the call is served anew."""
        for earlier in self.grants.leases.held_for(request.request_id, request.engine_id):
            self.grants.abandon(earlier, "its engine asked for the request again (the earlier answer was lost)")

    async def answer(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        """Check the call, run the prompt and hold it as a grant; StatusError for a refused or failed call."""
        return self.response(await self.hold(request, pipelined=request.pipelined))

    def check(self, request: pb.PrefillRequest) -> None:
        """StatusError for a Prefill that must not reach the engine (``hold`` checks it again)."""
        self._check(request)

    async def hold(self, request: pb.PrefillRequest, *, pipelined: bool) -> Grant:
        """Check the call, run the prompt and hold it as a grant, made once the engine allocated (``pipelined``,
        without DCP) or once the prompt is computed; StatusError for a refused or failed call. Every exit without
        a grant (errors, the caller cancelling) stops the engine and frees its allocation."""
        self._check(request)
        self._supersede(request)
        n = len(request.prompt_token_ids)
        dcp_ids = tuple(request.dcp_engine_ids)
        progress = PrefillProgress(request.request_id)
        job = PrefillInput(request_id=request.request_id, prompt_token_ids=tuple(request.prompt_token_ids),
                           mrope_positions=tuple(request.mrope_positions))
        task = asyncio.ensure_future(self._compute(job, progress, n))
        granted = False
        try:  # every exit without a grant (errors, the caller cancelling) stops the engine and frees
            out, prefill_ms, computed_at = await self._until_served(task, progress, pipelined=pipelined and not dcp_ids,
                                                       request_id=request.request_id)
            computing = out is None
            grant = Grant(grant_id=secrets.token_hex(16), request_id=request.request_id, engine_id=request.engine_id,
                          block_ids=progress.block_ids, ring_id=progress.ring_id, prompt_len=n,
                          live=ring_live_range(self.layout.config, n),
                          first_token=0 if computing else out.first_token, expires_at=self.grants.leases.expiry(),
                          progress=progress, prefill=task if computing else None,
                          piece_blocks=self._piece_blocks() if computing else 0, prefill_ms=prefill_ms,
                          computed_at=computed_at,
                          dcp_engine_ids=dcp_ids, dcp_interleave=request.dcp_interleave)
            if computing:
                task.add_done_callback(lambda t: self._prefilled(grant, t))
            self.grants.leases.add(grant)
            granted = True
        finally:
            if not granted:
                task.cancel()
                progress.release()
        return grant

    def response(self, grant: Grant) -> pb.PrefillResponse:
        """The Prefill response stating ``grant`` (just made by ``hold``)."""
        return pb.PrefillResponse(request_id=grant.request_id, grant_id=grant.grant_id, prompt_len=grant.prompt_len,
                                  num_blocks=len(grant.block_ids), ring_live=ring_message(grant.live),
                                  first_token=grant.first_token, lease_ms=int(self.config.lease_s * 1000),
                                  src_block_ids=grant.block_ids, src_ring_id=grant.ring_id,
                                  pipelined=grant.prefill is not None, piece_blocks=grant.piece_blocks,
                                  prefill_ms=grant.prefill_ms)

    async def _until_served(self, task: asyncio.Task, progress: PrefillProgress, *, pipelined: bool,
                            request_id: str) -> tuple[PrefillOutput | None, float, float]:
        """The engine's output, its ms and when it ended (perf_counter) once the prompt is computed, or (None, 0, 0)
        as soon as a pipelined call's allocation is served from (a DCP instance's ranks pull once the prompt is
        computed)."""
        try:
            if pipelined:
                allocated = asyncio.ensure_future(progress.wait_allocated())
                try:
                    await asyncio.wait({task, allocated}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    allocated.cancel()
                if not task.done():
                    return None, 0.0, 0.0
            return await task
        except asyncio.CancelledError:
            self.metrics.failures.labels("cancelled").inc()
            logger.info("prefill of request %s cancelled by its caller; freeing its allocation", request_id)
            raise
        except Exception as exc:
            status = status_of(exc, f"prefill node {self.engine_id}")
            if status.code is grpc.StatusCode.INTERNAL:
                logger.error("prefill engine failed on request %s", request_id, exc_info=exc)
            self.metrics.failures.labels(_CAUSES.get(status.code, "engine")).inc()
            raise status from None

    async def _compute(self, job: PrefillInput, progress: PrefillProgress, n: int) -> tuple[PrefillOutput, float, float]:
        """The engine's prefill, checked (``_checked``), how long it took (ms) and when it ended (perf_counter)."""
        started = time.perf_counter()
        out = self._checked(await self.engine.prefill(job, progress), progress, n)
        ended = time.perf_counter()
        return out, (ended - started) * 1000, ended

    def _checked(self, out: PrefillOutput, progress: PrefillProgress, n: int) -> PrefillOutput:
        """The engine's output, if it served an n-token prompt from an allocation of the blocks it needs
        (RuntimeError otherwise)."""
        want = self.layout.config.blocks_for_tokens(n)
        if out.prompt_len != n or progress.allocation is None or len(progress.block_ids) != want:
            raise RuntimeError(f"engine returned length {out.prompt_len} and served from {progress.allocation!r} for "
                               f"a {n}-token prompt that needs {want} blocks and a ring")
        progress.advance(n)
        return out

    def _piece_blocks(self) -> int:
        return max(1, self.config.piece_tokens // self.layout.config.block_size)

    def _prefilled(self, grant: Grant, task: asyncio.Task) -> None:
        """Done-callback of a pipelined grant's computation: its first token, or its failure (the grant is
        then released: freed once no pull reads it; a pull waiting on it aborts)."""
        if task.cancelled():
            grant.failure = grant.failure or "stopped"
            return
        try:
            out, prefill_ms, _ = task.result()
        except Exception as exc:
            grant.failure = f"{type(exc).__name__}: {exc}"
            self.metrics.failures.labels("engine").inc()
            logger.error("prefill of request %s (grant %s) failed after it was granted: %s", grant.request_id,
                         grant.grant_id, grant.failure)
            grant.release_requested = True
            self.grants.reap()
            return
        grant.first_token, grant.prefill_ms = out.first_token, prefill_ms

    def _dcp_problem(self, engine_id: str, ranks: tuple[str, ...], interleave: int) -> str | None:
        """What is wrong with a Prefill's DCP fields, or None."""
        if not 2 <= len(ranks) <= MAX_DCP_RANKS or ranks[0] != engine_id or len(set(ranks)) != len(ranks) \
                or not all(0 < len(r) <= MAX_ID_CHARS for r in ranks):
            return (f"dcp_engine_ids must name 2 to {MAX_DCP_RANKS} distinct engines of 1 to {MAX_ID_CHARS} "
                    f"characters, rank 0 being engine_id; got {len(ranks)}")
        try:
            DcpConfig.for_cache(self.layout.config, size=len(ranks), interleave=interleave or None)
        except ValueError as exc:
            return str(exc)
        return None
