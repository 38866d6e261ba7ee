"""PrefillConnector: the prefill node's gRPC service (Handshake, Prefill, Pull, Release,
Heartbeat) and the sending side of both transports.

Lifecycle: ``add_to_server(server)`` registers the service on the daemon's gRPC server (which
owns auth, TLS, health and reflection); ``await start()`` makes the UCX worker and starts the
lease reaper; after the server stopped, ``await stop()`` cancels the reaper, frees every grant and
closes UCX (also an async context manager). All state lives on the event loop that called
``start``; the engine is awaited there.

A node accepts a decode node whose layout arranges the same cache otherwise (block size, order,
kernel page): it sends its blocks as they are and the decode node converts them (see
``connector.shared.compat``). It refuses one
whose model identity differs (``model_identity``, given by the daemon).

A Handshake checks everything it is given before it changes anything: a refused one leaves the
engine's earlier state (its transports, UCX worker address and endpoint) as it was. A UCX worker
address reaches UCX in this process only after ``UcxNode.vet`` (its bytes checked, then a first
endpoint made in a child process). A decode engine not heard from (Handshake, Prefill, Pull,
Heartbeat) for ``FORGET_AFTER_LEASES`` leases, or ``FORGET_AFTER_FAILED_SEND_LEASES`` after a UCX
send to it failed, is forgotten with its UCX address and endpoint; Heartbeat tells a forgotten
engine (``engine_unknown``), which then handshakes again (``DecodeConnector`` does).

The server requires the peer credential on every RPC (``credential``). A grant belongs to the
handshaken decode engine whose Prefill made it (``PrefillRequest.engine_id``): Pull, Release and
Heartbeat naming another engine's grant answer PERMISSION_DENIED and touch nothing (no byte sent,
no lease renewed or released).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry

from connector import prefill_api as pb
from connector.shared import pull_frames, regions
from connector.shared.auth import Credential
from connector.shared.compat import MAX_MODEL_IDENTITY_CHARS, arrangement, model_differences, peer_layout
from connector.shared.config import ConnectorConfig, ucx_options_for
from connector.shared.dcp_plan import plan_dcp_transfer
from connector.prefill.engine import PrefillEngine, PrefillInput, PrefillOutput, PrefillProgress
from connector.shared.errors import CacheExhaustedError, EngineUnavailable, StatusError
from connector.prefill.leases import Grant, LeaseTable
from connector.shared.metrics import ConnectorMetrics
from connector.prefill.outbound import OutboundPull, PullAborted
from connector.shared.plan import plan_transfer, ready_at, ring_live_range
from connector.prefill.pull_session_server import serve_pull_session
from connector.shared.ucx import MAX_REGIONS, NOT_ENCRYPTED, UcxNode
from connector.prefill.ucx_address import WorkerAddressError
from connector.shared.wire import Transport, layout_message, ring_message, transports_from
from kvcache import CachePool, DcpConfig, DcpShard

logger = logging.getLogger(__name__)

MAX_ID_CHARS = 256
FORGET_AFTER_LEASES = 10  # a decode engine silent this many leases is forgotten (a live one heartbeats every lease)
FORGET_AFTER_FAILED_SEND_LEASES = 3  # the same, once a UCX send to it failed
MAX_DCP_RANKS = 64
VET_SHARE = 0.75  # of rpc_timeout_s, what vetting a new UCX worker address may take


class PrefillConnector(pb.PrefillServiceServicer):
    """Serves one prefill node's cache. Not thread-safe: one event loop."""

    def __init__(self, pool: CachePool, engine: PrefillEngine, *,
                 engine_id: str, config: ConnectorConfig, registry: CollectorRegistry,
                 transports: tuple[Transport, ...] = (Transport.UCX, Transport.GRPC_STREAM),
                 model_identity: str = "") -> None:
        if not isinstance(model_identity, str) or len(model_identity) > MAX_MODEL_IDENTITY_CHARS:
            raise ValueError(f"model_identity must be a string of at most {MAX_MODEL_IDENTITY_CHARS} characters")
        if not transports:
            raise ValueError("a prefill node must offer at least one transport")
        self.pool, self.engine = pool, engine
        self.engine_id = engine_id
        self.config = config
        self.layout = pool.layout
        self.transports = tuple(transports)
        self._offered_values = frozenset(t.value for t in self.transports)
        self.metrics = ConnectorMetrics(registry, "prefill")
        self.leases = LeaseTable(config.lease_s)
        self.model_identity = model_identity
        self._peers: dict[str, tuple[Transport, ...]] = {}
        self._heard: dict[str, float] = {}  # handshaken engine -> when it last called (monotonic)
        self._ucx: UcxNode | None = None
        self._reaper: asyncio.Task | None = None
        # Instrumentation (benchmarks): called with each Pull that sent everything, as its stream ends.
        self.on_pull_done: Callable[[OutboundPull], None] | None = None

    # lifecycle ---------------------------------------------------------------------------
    service_name = pb.SERVICE_NAME
    credential = Credential.PEER  # decode nodes' token, never a client's

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the PrefillService on ``server`` (the daemon's, which owns auth, TLS and health)."""
        pb.add_to_server(self, server, pull_response_serializer=pull_frames.serialize_response)

    async def start(self) -> None:
        """Make the UCX worker (when UCX is offered) and start the lease reaper; call it on the
        event loop that will serve the RPCs, before the server starts. Idempotent."""
        if Transport.UCX in self.transports and self._ucx is None:
            self._ucx = UcxNode(ucx_options_for(self.config.ucx_options, self.pool.device.type))
            self._ucx.start_vetting()
            if self.config.tls is not None:
                logger.warning(NOT_ENCRYPTED)
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="lease-reaper")
        logger.info("prefill connector %s started (%s)", self.engine_id, ", ".join(t.label for t in self.transports))

    @property
    def grants_held(self) -> int:
        """Grants handed out and not yet released or expired (a draining daemon waits for 0)."""
        return len(self.leases)

    async def stop(self) -> None:
        """Stop the reaper, free every grant and close UCX (idempotent). The caller stops the
        server first, so that no RPC reads the blocks being freed."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        for grant in self.leases.pop_all():
            self._free(grant)
        if self._ucx is not None:
            await self._ucx.stop_vetting()
            self._ucx.close()
            self._ucx = None

    async def __aenter__(self) -> "PrefillConnector":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # leases ------------------------------------------------------------------------------
    def _free(self, grant: Grant) -> None:
        """Release a grant's allocation (the engine's handle); a computation still running is stopped first
        (the engine writes nothing into it afterwards that a later request could read: see ``connector.prefill.engine``)."""
        if grant.computing:
            grant.failure = grant.failure or "its grant was freed"
            grant.prefill.cancel()
        grant.progress.release()

    def reap(self) -> int:
        """Free expired and released grants that no pull reads; returns how many expired."""
        expired = 0
        for grant in self.leases.take_expired():
            if not grant.release_requested:
                expired += 1
                self.metrics.leases_expired.inc()
                logger.warning("lease of grant %s (request %s) expired; freeing %d blocks",
                               grant.grant_id, grant.request_id, len(grant.block_ids))
            self._free(grant)
        return expired

    async def _reap_forever(self) -> None:
        period = min(max(self.config.lease_s / 10, 0.02), 1.0)
        while True:
            await asyncio.sleep(period)
            self.reap()
            self.forget_silent()

    # decode engines ----------------------------------------------------------------------
    def _heard_from(self, engine_id: str) -> None:
        """Note a call from a handshaken engine (unknown ones are not tracked)."""
        if engine_id in self._peers:
            self._heard[engine_id] = time.monotonic()

    def forget_silent(self, now: float | None = None) -> list[str]:
        """Forget the handshaken engines not heard from for ``FORGET_AFTER_LEASES`` leases, or for
        ``FORGET_AFTER_FAILED_SEND_LEASES`` when the last UCX send to them failed: their transports,
        UCX worker address and endpoint. The reaper calls it; ``now`` (``time.monotonic()``) is for
        tests. Returns the engines forgotten."""
        now = time.monotonic() if now is None else now
        gone = []
        for engine_id in list(self._peers):
            heard = self._heard.get(engine_id, now)
            failed = self._ucx.send_failed_at(engine_id) if self._ucx is not None else None
            leases = FORGET_AFTER_FAILED_SEND_LEASES if failed is not None else FORGET_AFTER_LEASES
            if now - heard >= leases * self.config.lease_s:
                gone.append(engine_id)
                self._forget(engine_id, f"not heard from for {now - heard:.1f} s"
                             + (" after a failed UCX send" if failed is not None else ""))
        return gone

    def _forget(self, engine_id: str, why: str) -> None:
        self._peers.pop(engine_id, None)
        self._heard.pop(engine_id, None)
        if self._ucx is not None:
            self._ucx.forget(engine_id)
        logger.info("forgetting decode engine %s (%s); it must handshake again", engine_id, why)

    # RPCs --------------------------------------------------------------------------------
    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        """Check the decode engine's id, layout, model and UCX worker address, then (only if all
        pass) record it. INVALID_ARGUMENT for a malformed id or address, FAILED_PRECONDITION for a
        layout or model mismatch, UNAVAILABLE when UCX cannot reach the address; a refusal is logged
        as a warning and changes nothing about the engine."""
        engine_id = request.engine_id
        if not engine_id or len(engine_id) > MAX_ID_CHARS:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_engine_id", engine_id[:MAX_ID_CHARS],
                               f"engine_id must have 1 to {MAX_ID_CHARS} characters")
        theirs, differing = peer_layout(self.layout, request.layout)
        if theirs is None:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "layout_mismatch", engine_id,
                               f"cache layout differs from prefill node {self.engine_id}: fields {differing}")
        if len(request.model_identity) > MAX_MODEL_IDENTITY_CHARS:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_model_identity", engine_id,
                               f"model_identity has {len(request.model_identity)} characters "
                               f"(limit {MAX_MODEL_IDENTITY_CHARS})")
        model = model_differences(self.model_identity, request.model_identity)
        if model:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "model_mismatch", engine_id,
                               f"model differs (prefill node {self.engine_id} vs engine {engine_id}): {'; '.join(model)}")
        offered = transports_from(request.transports)
        if Transport.UCX in offered and self._ucx is not None:
            await self._reach(context, engine_id, request.ucx_worker_address, request.ucx_warmup_tag)
        if differing:
            logger.info("engine %s stores %s, this node %s; it converts what it pulls", engine_id,
                        arrangement(theirs), arrangement(self.layout))
        self._peers[engine_id] = offered
        self._heard_from(engine_id)
        return pb.HandshakeResponse(
            engine_id=self.engine_id, layout=layout_message(self.layout),
            transports=[t.value for t in self.transports],
            ucx_worker_address=self._ucx.address if self._ucx is not None else b"",
            lease_ms=int(self.config.lease_s * 1000), max_prompt_tokens=self.config.max_prompt_tokens,
            chunk_bytes=self.config.chunk_bytes, model_identity=self.model_identity, pull_session=True,
        )

    async def _reach(self, context, engine_id: str, address: bytes, warmup_tag: int) -> None:
        """Vet ``address`` and make the UCX endpoint to it, which becomes ``engine_id``'s only when
        made, then (``warmup_tag`` nonzero) send the empty warm-up message through it; aborts the
        Handshake otherwise (the engine's earlier endpoint and address untouched until made)."""
        if not address:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "ucx_address", engine_id,
                               "UCX offered without a ucx_worker_address")
        started = time.monotonic()
        try:
            await self._ucx.vet(address, VET_SHARE * self.config.rpc_timeout_s)
            left = max(self.config.rpc_timeout_s - (time.monotonic() - started), 0.1)
            await asyncio.wait_for(self._ucx.connect(engine_id, address), left)
            if warmup_tag:
                left = max(self.config.rpc_timeout_s - (time.monotonic() - started), 0.1)
                await asyncio.wait_for(self._ucx.warm_up(engine_id, warmup_tag), left)
        except WorkerAddressError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "ucx_address", engine_id,
                               f"ucx_worker_address refused: {exc}")
        except Exception as exc:  # UcxUnreachableError, a time-out, or UCX's own error
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, "ucx_unreachable", engine_id,
                               f"cannot make a UCX endpoint to engine {engine_id}: {type(exc).__name__}: {exc}")

    async def _refuse(self, context, code: grpc.StatusCode, cause: str, engine_id: str, message: str) -> None:
        """Count, log (a warning naming the engine and why) and abort a Handshake."""
        self.metrics.failures.labels(cause).inc()
        logger.warning("handshake of engine %r refused (%s): %s", engine_id, code.name, message)
        await context.abort(code, message)

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        """Check the call, then run the prompt through the engine. A pipelined call (``request.pipelined``)
        is answered once the engine allocated the blocks, its grant's computation going on behind (the
        Pull moves the blocks as the chunks complete them); otherwise once the prompt is computed."""
        n = len(request.prompt_token_ids)
        if not request.request_id or len(request.request_id) > MAX_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id must have 1 to {MAX_ID_CHARS} characters")
        if not 1 <= n <= self.config.max_prompt_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt has {n} tokens; must have 1 to {self.config.max_prompt_tokens}")
        if request.engine_id not in self._peers:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"engine {request.engine_id[:MAX_ID_CHARS]!r} has not handshaken")
        self._heard_from(request.engine_id)
        if len(self.leases) >= self.config.max_grants:
            self.metrics.failures.labels("too_many_grants").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(self.leases)} grants held (limit {self.config.max_grants})")
        if self.leases.active_request(request.request_id, request.engine_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id!r} already holds a grant")
        dcp_ids, dcp_interleave = tuple(request.dcp_engine_ids), request.dcp_interleave
        if dcp_ids:
            problem = self._dcp_problem(request.engine_id, dcp_ids, dcp_interleave)
            if problem:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        grant_id = secrets.token_hex(16)
        progress = PrefillProgress(request.request_id)
        job = PrefillInput(request_id=request.request_id, prompt_token_ids=tuple(request.prompt_token_ids))
        task = asyncio.ensure_future(self._compute(job, progress, n))
        granted = False
        try:  # every exit without a grant (errors, aborts, the caller cancelling) stops the engine and frees
            out = None
            try:
                if request.pipelined and not dcp_ids:  # a DCP instance's ranks pull once the prompt is computed
                    allocated = asyncio.ensure_future(progress.wait_allocated())
                    try:
                        await asyncio.wait({task, allocated}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        allocated.cancel()
                    if task.done():
                        out, prefill_ms, _ = task.result()
                else:
                    out, prefill_ms, _ = await task
            except CacheExhaustedError as exc:
                self.metrics.failures.labels("cache_exhausted").inc()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except EngineUnavailable as exc:
                self.metrics.failures.labels("engine_unavailable").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill node {self.engine_id} unavailable: {exc}")
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except asyncio.CancelledError:
                self.metrics.failures.labels("cancelled").inc()
                logger.info("prefill of request %s cancelled by its caller; freeing its allocation", request.request_id)
                raise
            except Exception as exc:
                logger.exception("prefill engine failed on request %s", request.request_id)
                self.metrics.failures.labels("engine").inc()
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {exc}")
            live = ring_live_range(self.layout.config, n)
            pipelined = out is None
            grant = Grant(grant_id=grant_id, request_id=request.request_id, engine_id=request.engine_id,
                          block_ids=progress.block_ids, ring_id=progress.ring_id, prompt_len=n, live=live,
                          first_token=0 if pipelined else out.first_token, expires_at=self.leases.expiry(),
                          progress=progress, prefill=task if pipelined else None,
                          piece_blocks=self._piece_blocks() if pipelined else 0,
                          prefill_ms=0.0 if pipelined else prefill_ms,
                          dcp_engine_ids=dcp_ids, dcp_interleave=dcp_interleave)
            if pipelined:
                task.add_done_callback(lambda t: self._prefilled(grant, t))
            self.leases.add(grant)
            granted = True
        finally:
            if not granted:
                task.cancel()
                progress.release()
        return pb.PrefillResponse(request_id=request.request_id, grant_id=grant_id, prompt_len=n,
                                  num_blocks=len(grant.block_ids), ring_live=ring_message(live),
                                  first_token=grant.first_token, lease_ms=int(self.config.lease_s * 1000),
                                  src_block_ids=grant.block_ids, src_ring_id=grant.ring_id, pipelined=pipelined,
                                  piece_blocks=grant.piece_blocks, prefill_ms=grant.prefill_ms)

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
            self.reap()
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

    @staticmethod
    def _shard(grant: Grant, rank: int) -> DcpShard:
        return DcpShard(size=len(grant.dcp_engine_ids), rank=rank, interleave=grant.dcp_interleave)

    def _pulls_as(self, grant: Grant, request: pb.PullRequest | pb.ReleaseRequest) -> bool:
        """Whether the request's engine may pull or release (its share of) ``grant``."""
        if not grant.dcp_engine_ids:
            return grant.engine_id == request.engine_id
        rank = request.dcp_rank
        return rank < len(grant.dcp_engine_ids) and grant.dcp_engine_ids[rank] == request.engine_id

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        grant = self.leases.live(request.grant_id)
        if grant is None:
            return pb.ReleaseResponse(released=False)
        if not self._pulls_as(grant, request) or (request.all_ranks and request.dcp_rank != 0):
            await self._refuse_foreign(context, "Release", request.engine_id)
        if grant.dcp_engine_ids and not request.all_ranks:
            grant.release_rank(request.dcp_rank)
        else:
            grant.release_requested = True
        if grant.release_requested and grant.computing:  # nobody wants the rest of the prompt: a pull still
            grant.failure = "its grant was released"      # reading it fails at once
            grant.prefill.cancel()
        self.reap()  # frees it now unless a pull still reads it (then when that pull ends)
        return pb.ReleaseResponse(released=True)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        if len(request.grant_ids) > self.config.max_grants:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.grant_ids)} grant ids (limit {self.config.max_grants})")
        foreign = [g for g in request.grant_ids
                   if (grant := self.leases.live(g)) is not None and not grant.owned_by(request.engine_id)]
        if foreign:  # checked before renewing any: a refused call changes nothing
            await self._refuse_foreign(context, "Heartbeat", request.engine_id, len(foreign))
        unknown = [g for g in request.grant_ids if not self.leases.renew(g)]
        self._heard_from(request.engine_id)
        return pb.HeartbeatResponse(unknown_grant_ids=unknown, lease_ms=int(self.config.lease_s * 1000),
                                    engine_unknown=request.engine_id not in self._peers)

    async def _refuse_foreign(self, context, what: str, engine_id: str, count: int = 1) -> None:
        """Abort with ``_foreign``'s PERMISSION_DENIED."""
        exc = self._foreign(what, engine_id, count)
        await context.abort(exc.code, exc.message)

    def _foreign(self, what: str, engine_id: str, count: int = 1) -> StatusError:
        """PERMISSION_DENIED, counted and logged: ``engine_id`` named ``count`` grants made for another
        engine (which one is not said)."""
        self.metrics.failures.labels("foreign_grant").inc()
        logger.warning("%s by engine %r refused: %d grant%s of another engine", what, engine_id[:MAX_ID_CHARS], count,
                       "" if count == 1 else "s")
        return StatusError(grpc.StatusCode.PERMISSION_DENIED,
                           f"{what}: {count} grant{'' if count == 1 else 's'} not made for engine "
                           f"{engine_id[:MAX_ID_CHARS]!r}")

    async def Pull(self, request: pb.PullRequest, context):
        try:
            async with contextlib.aclosing(self.pull_messages(request)) as messages:  # a cancelled call stops it now
                async for message in messages:
                    yield message
        except StatusError as exc:
            await context.abort(exc.code, exc.message)

    async def PullSession(self, requests, context):
        """One decode node's UCX pulls on one stream (``connector.prefill.pull_session_server``)."""
        async for message in serve_pull_session(requests, self.pull_messages):
            yield message

    async def pull_messages(self, request: pb.PullRequest):
        """The messages of one pull of ``request``, as a Pull stream sends them; StatusError for a pull
        refused or failed (the status its stream ends with). Closing the generator early stops its sends."""
        grant = self.leases.live(request.grant_id)
        if grant is None:
            self.metrics.failures.labels("unknown_grant").inc()
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"grant {request.grant_id!r} is unknown, released or expired")
        if not self._pulls_as(grant, request):
            raise self._foreign("Pull", request.engine_id)
        if request.transport not in self._offered_values:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"transport {request.transport} not offered; this node offers {[t.label for t in self.transports]}")
        transport = Transport(request.transport)
        if request.engine_id not in self._peers:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"engine {request.engine_id!r} has not handshaken")
        self._heard_from(request.engine_id)
        if transport is Transport.UCX and (self._ucx is None or Transport.UCX not in self._peers[request.engine_id]
                                           or not self._ucx.knows(request.engine_id)):
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"engine {request.engine_id!r} offered no UCX worker address")
        if transport is Transport.UCX and request.ucx_tag_base == 0:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "ucx_tag_base must be a random nonzero 64-bit value")
        shard = self._shard(grant, request.dcp_rank) if grant.dcp_engine_ids else None
        want = shard.blocks_for_tokens(self.layout.config, grant.prompt_len) if shard else len(grant.block_ids)
        if len(request.dst_block_ids) != want:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{len(request.dst_block_ids)} destination blocks for a grant of {want} blocks"
                              + (f" (rank {shard.rank} of {shard.size})" if shard else ""))
        try:
            if shard is None:
                plan = plan_transfer(self.layout, grant.block_ids, list(request.dst_block_ids), grant.ring_id,
                                     request.dst_ring_id, grant.live, piece_blocks=grant.piece_blocks)
            else:
                plan = plan_dcp_transfer(self.layout, grant.block_ids, list(request.dst_block_ids), grant.ring_id,
                                         request.dst_ring_id, grant.live, shard, grant.prompt_len)
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if len(plan) > MAX_REGIONS:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{len(plan)} regions (limit {MAX_REGIONS})")

        grant.pulls_in_flight += 1
        views = [regions.region_view(self.pool, p.src) for p in plan.pairs]
        started = time.perf_counter()
        budget = self.config.transfer_timeout_s + (self.config.rpc_timeout_s if grant.computing else 0.0)
        outbound = OutboundPull(grant, plan, views, ready_at(plan, self.layout.block_bytes, self.layout.config.block_size,
                                                             grant.prompt_len),
                                transport=transport, engine_id=request.engine_id, ucx=self._ucx,
                                tag_base=request.ucx_tag_base, chunk_bytes=self.config.chunk_bytes,
                                integrity=request.integrity, deadline=time.monotonic() + budget)
        finished = False
        try:
            try:
                async for message in outbound.messages():
                    if not isinstance(message, bytes) and message.WhichOneof("message") == "done":
                        finished = True
                        self.metrics.transferred(transport.label, plan.total_bytes, len(plan),
                                                 time.perf_counter() - started)
                    yield message
            except PullAborted as exc:
                self.metrics.failures.labels(exc.cause).inc()
                raise StatusError(exc.code, exc.message) from None
        finally:
            outbound.stop_sends()
            if finished and self.on_pull_done is not None:
                self.on_pull_done(outbound)
            if not finished:  # the sends still running were stopped: none reads our blocks any more
                self.metrics.failures.labels("pull_aborted").inc()
                logger.warning("pull of grant %s by %s ended before its last byte", grant.grant_id, request.engine_id)
            grant.pulls_in_flight -= 1
            self.reap()
