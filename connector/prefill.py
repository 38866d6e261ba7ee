"""PrefillConnector: the prefill node's gRPC service (Handshake, Prefill, Pull, Release,
Heartbeat) and the sending side of both transports.

Lifecycle: ``add_to_server(server)`` registers the service on the daemon's gRPC server (which
owns auth, TLS, health and reflection); ``await start()`` makes the UCX worker and starts the
lease reaper; after the server stopped, ``await stop()`` cancels the reaper, frees every grant and
closes UCX (also an async context manager). All state lives on the event loop that called
``start``; the engine is awaited there.

A node accepts a decode node whose layout differs from its own only in ``order``: it sends its
blocks as they are and the decode node converts them (see ``connector.compat``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import grpc
from prometheus_client import CollectorRegistry

from connector import prefill_api as pb
from connector import regions
from connector.compat import peer_layout
from connector.config import ConnectorConfig
from connector.engine import PrefillCache, PrefillEngine, PrefillInput
from connector.errors import CacheExhaustedError, EngineUnavailable
from connector.leases import Grant, LeaseTable
from connector.metrics import ConnectorMetrics
from connector.plan import plan_transfer, ring_live_range
from connector.ucx import MAX_REGIONS, UcxNode
from connector.wire import Transport, layout_message, ring_message
from kvcache import BlockAllocator, CachePool, RingAllocator

logger = logging.getLogger(__name__)

MAX_ID_CHARS = 256


class PrefillConnector(pb.PrefillServiceServicer):
    """Serves one prefill node's cache. Not thread-safe: one event loop."""

    def __init__(self, pool: CachePool, blocks: BlockAllocator, rings: RingAllocator, engine: PrefillEngine, *,
                 engine_id: str, config: ConnectorConfig, registry: CollectorRegistry,
                 transports: tuple[Transport, ...] = (Transport.UCX, Transport.GRPC_STREAM)) -> None:
        if blocks.num_blocks != pool.num_blocks or rings.num_rings != pool.num_rings:
            raise ValueError(f"allocators ({blocks.num_blocks} blocks, {rings.num_rings} rings) do not match the pool "
                             f"({pool.num_blocks} blocks, {pool.num_rings} rings)")
        if not transports:
            raise ValueError("a prefill node must offer at least one transport")
        self.pool, self.blocks, self.rings, self.engine = pool, blocks, rings, engine
        self.engine_id = engine_id
        self.config = config
        self.layout = pool.layout
        self.transports = tuple(transports)
        self.metrics = ConnectorMetrics(registry, "prefill")
        self.metrics.watch_free(lambda: blocks.num_free, lambda: rings.num_free)
        self.leases = LeaseTable(config.lease_s)
        self._peers: dict[str, tuple[Transport, ...]] = {}
        self._ucx: UcxNode | None = None
        self._reaper: asyncio.Task | None = None

    # lifecycle ---------------------------------------------------------------------------
    service_name = pb.SERVICE_NAME

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the PrefillService on ``server`` (the daemon's, which owns auth, TLS and health)."""
        pb.add_PrefillServiceServicer_to_server(self, server)

    async def start(self) -> None:
        """Make the UCX worker (when UCX is offered) and start the lease reaper; call it on the
        event loop that will serve the RPCs, before the server starts. Idempotent."""
        if Transport.UCX in self.transports and self._ucx is None:
            self._ucx = UcxNode(self.config.ucx_options)
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
            self._ucx.close()
            self._ucx = None

    async def __aenter__(self) -> "PrefillConnector":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # leases ------------------------------------------------------------------------------
    def _free(self, grant: Grant | None) -> None:
        if grant is None:
            return
        self.blocks.free(list(grant.block_ids))
        self.rings.free(grant.grant_id)

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

    # RPCs --------------------------------------------------------------------------------
    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        if not request.engine_id or len(request.engine_id) > MAX_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"engine_id must have 1 to {MAX_ID_CHARS} characters")
        theirs, differing = peer_layout(self.layout, request.layout)
        if theirs is None:
            self.metrics.failures.labels("layout_mismatch").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"cache layout differs from prefill node {self.engine_id}: fields {differing}")
        if differing:
            logger.info("engine %s stores blocks in %s order, this node in %s; it converts what it pulls",
                        request.engine_id, theirs.config.order.value, self.layout.config.order.value)
        offered = tuple(Transport(t) for t in request.transports if t in {x.value for x in Transport})
        if Transport.UCX in offered and self._ucx is not None:
            if not request.ucx_worker_address:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "UCX offered without a ucx_worker_address")
            self._ucx.remember(request.engine_id, request.ucx_worker_address)
            try:  # reach the decode node's worker now, so that an unreachable one fails the Handshake
                await asyncio.wait_for(self._ucx.endpoint(request.engine_id), self.config.rpc_timeout_s)
            except Exception as exc:
                self._ucx.forget(request.engine_id)
                self.metrics.failures.labels("ucx_unreachable").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"cannot make a UCX endpoint to engine {request.engine_id}: {type(exc).__name__}: {exc}")
        self._peers[request.engine_id] = offered
        return pb.HandshakeResponse(
            engine_id=self.engine_id, layout=layout_message(self.layout),
            transports=[t.value for t in self.transports],
            ucx_worker_address=self._ucx.address if self._ucx is not None else b"",
            lease_ms=int(self.config.lease_s * 1000), max_prompt_tokens=self.config.max_prompt_tokens,
            chunk_bytes=self.config.chunk_bytes,
        )

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        n = len(request.prompt_token_ids)
        if not request.request_id or len(request.request_id) > MAX_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id must have 1 to {MAX_ID_CHARS} characters")
        if not 1 <= n <= self.config.max_prompt_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt has {n} tokens; must have 1 to {self.config.max_prompt_tokens}")
        if len(self.leases) >= self.config.max_grants:
            self.metrics.failures.labels("too_many_grants").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(self.leases)} grants held (limit {self.config.max_grants})")
        if self.leases.active_request(request.request_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id!r} already holds a grant")
        grant_id = secrets.token_hex(16)
        cache = PrefillCache(self.pool, self.blocks, self.rings, grant_id)
        job = PrefillInput(request_id=request.request_id, prompt_token_ids=tuple(request.prompt_token_ids))
        granted = False
        try:  # every exit without a grant (errors, aborts, the caller cancelling) frees the allocation
            try:
                out = await self.engine.prefill(job, cache)
                want = self.layout.config.blocks_for_tokens(n)
                if out.prompt_len != n or tuple(out.block_ids) != cache.block_ids or out.ring_id != cache.ring_id \
                        or len(out.block_ids) != want:
                    raise RuntimeError(f"engine returned {len(out.block_ids)} blocks / ring {out.ring_id} / length "
                                       f"{out.prompt_len} for a {n}-token prompt that needs {want} blocks from its own allocation")
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
            self.leases.add(Grant(grant_id=grant_id, request_id=request.request_id, block_ids=tuple(out.block_ids),
                                  ring_id=out.ring_id, prompt_len=n, live=live, first_token=out.first_token,
                                  expires_at=self.leases.expiry()))
            granted = True
        finally:
            if not granted:
                cache.rollback()
        return pb.PrefillResponse(request_id=request.request_id, grant_id=grant_id, prompt_len=n,
                                  num_blocks=len(out.block_ids), ring_live=ring_message(live),
                                  first_token=out.first_token, lease_ms=int(self.config.lease_s * 1000))

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        grant = self.leases.live(request.grant_id)
        if grant is None:
            return pb.ReleaseResponse(released=False)
        grant.release_requested = True
        self.reap()  # frees it now unless a pull still reads it (then when that pull ends)
        return pb.ReleaseResponse(released=True)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        if len(request.grant_ids) > self.config.max_grants:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.grant_ids)} grant ids (limit {self.config.max_grants})")
        unknown = [g for g in request.grant_ids if not self.leases.renew(g)]
        return pb.HeartbeatResponse(unknown_grant_ids=unknown, lease_ms=int(self.config.lease_s * 1000))

    async def Pull(self, request: pb.PullRequest, context):
        grant = self.leases.live(request.grant_id)
        if grant is None:
            self.metrics.failures.labels("unknown_grant").inc()
            await context.abort(grpc.StatusCode.NOT_FOUND, f"grant {request.grant_id!r} is unknown, released or expired")
        if request.transport not in {t.value for t in self.transports}:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"transport {request.transport} not offered; this node offers {[t.label for t in self.transports]}")
        transport = Transport(request.transport)
        if request.engine_id not in self._peers:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"engine {request.engine_id!r} has not handshaken")
        if transport is Transport.UCX and (self._ucx is None or not self._ucx.knows(request.engine_id)):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"engine {request.engine_id!r} offered no UCX worker address")
        if transport is Transport.UCX and request.ucx_tag_base == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ucx_tag_base must be a random nonzero 64-bit value")
        if len(request.dst_block_ids) != len(grant.block_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.dst_block_ids)} destination blocks for a grant of {len(grant.block_ids)} blocks")
        try:
            plan = plan_transfer(self.layout, grant.block_ids, list(request.dst_block_ids), grant.ring_id,
                                 request.dst_ring_id, grant.live)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if len(plan) > MAX_REGIONS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(plan)} regions (limit {MAX_REGIONS})")

        grant.pulls_in_flight += 1
        views = [regions.region_view(self.pool, p.src) for p in plan.pairs]
        started = time.perf_counter()
        finished = False
        try:
            yield pb.PullResponse(grant=pb.PullGrant(
                src_block_ids=grant.block_ids, src_ring_id=grant.ring_id, ring_live=ring_message(grant.live),
                num_regions=len(plan), total_bytes=plan.total_bytes))
            checksums = [regions.crc32(v) for v in views] if request.integrity else []
            if transport is Transport.GRPC_STREAM:
                step = self.config.chunk_bytes
                for index, view in enumerate(views):
                    for off in range(0, view.numel(), step):
                        data = regions.read_bytes(view[off:off + step])
                        yield pb.PullResponse(chunk=pb.Chunk(region=index, offset=off, data=data))
            else:
                try:
                    await asyncio.wait_for(self._ucx.send(request.engine_id, views, request.ucx_tag_base),
                                           self.config.transfer_timeout_s)
                except asyncio.TimeoutError:
                    self.metrics.failures.labels("deadline").inc()
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"UCX sends to {request.engine_id} did not complete in {self.config.transfer_timeout_s} s")
            finished = True
            self.metrics.transferred(transport.label, plan.total_bytes, len(plan), time.perf_counter() - started)
            yield pb.PullResponse(done=pb.PullDone(bytes=plan.total_bytes, regions=len(plan), crc32=checksums))
        finally:
            if not finished:  # UcxNode.send dropped its endpoint: no send reads our blocks any more
                self.metrics.failures.labels("pull_aborted").inc()
                logger.warning("pull of grant %s by %s ended before its last byte", grant.grant_id, request.engine_id)
            grant.pulls_in_flight -= 1
            self.reap()
