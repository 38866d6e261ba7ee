"""The Pull and PullSession RPCs on the prefill node: a grant's pull checked, planned once, and served
(``kpool_pd.connector.prefill.outbound``) to the engine that holds it.

A pull is checked against its grant (it must be the grant's engine or DCP rank, over a transport both
offered, into as many blocks as the grant lands in), then planned once (``plan_pull``: the regions and
when each may move); the plan serves the whole stream. A pull keeps its grant from being freed until it
ends; a pull that ends before its last byte stops its sends first (``OutboundPull.stop_sends``). A pull
whose caller went away (its Pull call cancelled, its PullSession broken: the decode node died or gave up)
while the prompt is still being computed abandons its grant: the engine computes no further chunk of it
and the grant is freed at once (``GrantKeeper.abandon``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.decode_engines import DecodeEngineTable
from kpool_pd.connector.prefill.grants import GrantKeeper
from kpool_pd.connector.prefill.leases import Grant
from kpool_pd.connector.prefill.outbound import OutboundPull, PullAborted
from kpool_pd.connector.prefill.ucx_link import UcxLink
from kpool_pd.connector.shared import hops, regions
from kpool_pd.connector.shared.config import ConnectorConfig
from kpool_pd.connector.shared.dcp_plan import plan_dcp_transfer
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.metrics import ConnectorMetrics
from kpool_pd.connector.shared.plan import TransferPlan, plan_transfer, ready_at, without_held
from kpool_pd.connector.shared.ucx import MAX_REGIONS
from kpool_pd.connector.shared.wire import Transport
from kpool_pd.kvcache import BlockLayout, CachePool, DcpShard

logger = logging.getLogger(__name__)


def plan_pull(layout: BlockLayout, grant: Grant, request: pb.PullRequest) -> tuple[TransferPlan, list[int]]:
    """The one plan of a pull of ``grant`` into ``request``'s blocks and ring (a DCP rank: its share; without
    the blocks the puller holds, ``held_block_indices``), and for each region how many prompt tokens must be
    written before it may move (``ready_at``). StatusError INVALID_ARGUMENT for a wrong number of blocks, ids
    or held indices out of range, or too many regions; FAILED_PRECONDITION for held blocks with DCP or a
    prompt still computing."""
    shard = DcpShard(size=len(grant.dcp_engine_ids), rank=request.dcp_rank, interleave=grant.dcp_interleave) \
        if grant.dcp_engine_ids else None
    want = shard.blocks_for_tokens(layout.config, grant.prompt_len) if shard else len(grant.block_ids)
    if len(request.dst_block_ids) != want:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(request.dst_block_ids)} destination blocks for a grant of {want} blocks"
                          + (f" (rank {shard.rank} of {shard.size})" if shard else ""))
    if request.held_block_indices and (shard is not None or grant.computing):
        raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, "held blocks (a prefix hit) are skipped only by a "
                          "pull of a computed prompt without DCP")
    try:
        if shard is None:
            src, dst = without_held(grant.block_ids, list(request.dst_block_ids), list(request.held_block_indices))
            plan = plan_transfer(layout, src, dst, grant.ring_id, request.dst_ring_id, grant.live,
                                 piece_blocks=grant.piece_blocks)
        else:
            plan = plan_dcp_transfer(layout, grant.block_ids, list(request.dst_block_ids), grant.ring_id,
                                     request.dst_ring_id, grant.live, shard, grant.prompt_len)
    except ValueError as exc:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    if len(plan) > MAX_REGIONS:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{len(plan)} regions (limit {MAX_REGIONS})")
    return plan, ready_at(plan, layout, grant.prompt_len)


class PullDesk:
    """Serves the pulls of the grants ``grants`` keeps from ``pool`` to the engines in ``engines``, over the
    ``transports`` this node offers."""

    def __init__(self, *, pool: CachePool, config: ConnectorConfig, transports: tuple[Transport, ...],
                 engines: DecodeEngineTable, grants: GrantKeeper, metrics: ConnectorMetrics) -> None:
        self.pool, self.layout, self.config, self.transports = pool, pool.layout, config, transports
        self.engines, self.grants, self.metrics = engines, grants, metrics
        self._offered_values = frozenset(t.value for t in transports)
        # Instrumentation (benchmarks): called with each Pull that sent everything, as its stream ends.
        self.on_pull_done: Callable[[OutboundPull], None] | None = None

    def _checked(self, request: pb.PullRequest) -> tuple[Grant, Transport, UcxLink | None]:
        """The grant and transport of a pull that may go on; StatusError otherwise (PERMISSION_DENIED first of
        all for a pull naming an engine without its secret)."""
        engine = self.grants.authenticate(request.engine_id, request.engine_secret, "Pull")
        grant = self.grants.leases.live(request.grant_id)
        if grant is None:
            self.metrics.failures.labels("unknown_grant").inc()
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"grant {request.grant_id!r} is unknown, released or expired")
        self.grants.claim(grant, request.engine_id)
        if not self.grants.pulls_as(grant, request.engine_id, request.dcp_rank):
            raise self.grants.foreign("Pull", request.engine_id)
        if request.transport not in self._offered_values:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"transport {request.transport} not offered; this node offers {[t.label for t in self.transports]}")
        transport = Transport(request.transport)
        self.engines.heard_from(request.engine_id)
        if transport is Transport.UCX and not engine.reaches_over(Transport.UCX):
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"engine {request.engine_id!r} offered no UCX worker address")
        if transport is Transport.UCX and request.ucx_tag_base == 0:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "ucx_tag_base must be a random nonzero 64-bit value")
        return grant, transport, engine.link if transport is Transport.UCX else None

    async def pull_messages(self, request: pb.PullRequest):
        """The messages of one pull of ``request``, as a Pull stream sends them; StatusError for a pull
        refused or failed (the status its stream ends with). Closing the generator early stops its sends."""
        grant, transport, link = self._checked(request)
        plan, ready = plan_pull(self.layout, grant, request)
        hops.stamp(grant.grant_id, "checked")
        grant.pulls_in_flight += 1
        views = [regions.region_view(self.pool, p.src) for p in plan.pairs]
        started = time.perf_counter()
        outbound = OutboundPull(grant, plan, views, ready, transport=transport, engine_id=request.engine_id,
                                link=link, tag_base=request.ucx_tag_base, chunk_bytes=self.config.chunk_bytes,
                                integrity=request.integrity,
                                deadline=time.monotonic() + self.config.pull_budget_s(computing=grant.computing))
        finished = caller_left = False
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
        except (GeneratorExit, asyncio.CancelledError):  # its call was cancelled, or its stream broke
            caller_left = True
            raise
        finally:
            outbound.stop_sends()
            if finished and self.on_pull_done is not None:
                self.on_pull_done(outbound)
            if not finished:  # the sends still running were stopped: none reads our blocks any more
                self.metrics.failures.labels("pull_aborted").inc()
                logger.warning("pull of grant %s by %s ended before its last byte", grant.grant_id, request.engine_id)
            grant.pulls_in_flight -= 1
            if caller_left and not finished and grant.computing:  # its decode engine went away mid-prompt
                self.grants.abandon(grant, f"its pull by {request.engine_id} ended before the prompt was computed")
            self.grants.reap()
