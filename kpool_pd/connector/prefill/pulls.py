"""The Pull and PullSession RPCs on the prefill node: a grant's pull checked and served
(``kpool_pd.connector.prefill.outbound``) to the engine that holds it.

A pull is checked against its grant: it must be the grant's engine or DCP rank, over a transport both
offered, and the plan it carries (the decode node planned it once) must read only what the grant holds
(``kpool_pd.connector.prefill.served_plan``, which also says when each region may move); that plan serves
the whole stream, and this node plans nothing. A pull keeps its grant from being freed until it
ends; a pull that ends before its last byte stops its sends first (``OutboundPull.stop_sends``). A pull
whose caller went away (its Pull call cancelled, its PullSession broken: the decode node died or gave up)
while the prompt is still being computed abandons its grant: the engine computes no further chunk of it
and the grant is freed at once (``GrantKeeper.abandon``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.decode_engines import DecodeEngine, DecodeEngineTable
from kpool_pd.connector.prefill.grants import GrantKeeper
from kpool_pd.connector.prefill.leases import Grant
from kpool_pd.connector.prefill.outbound import OutboundPull, PullAborted
from kpool_pd.connector.prefill.served_plan import served_plan
from kpool_pd.connector.prefill.ucx_link import UcxLink
from kpool_pd.connector.shared import hops, regions
from kpool_pd.connector.shared.config import ConnectorConfig
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.metrics import ConnectorMetrics
from kpool_pd.connector.shared.wire import Transport
from kpool_pd.kvcache import CachePool

logger = logging.getLogger(__name__)


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

    def checked(self, request: pb.PullRequest) -> tuple[Grant, Transport, UcxLink | None]:
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
        transport, link = self.transport_for(engine, request.transport, request.ucx_tag_base)
        return grant, transport, link

    def transport_for(self, engine: DecodeEngine, transport: int, ucx_tag_base: int) -> tuple[Transport, UcxLink | None]:
        """The transport (a ``kpoolpd.v1.Transport`` value) an authenticated engine pulls over, and its UCX link
        for UCX; StatusError for one this node does not offer, UCX to an engine without a worker address, or UCX
        without a tag base."""
        if transport not in self._offered_values:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"transport {transport} not offered; this node offers {[t.label for t in self.transports]}")
        chosen = Transport(transport)
        self.engines.heard_from(engine.engine_id)
        if chosen is Transport.UCX and not engine.reaches_over(Transport.UCX):
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"engine {engine.engine_id!r} offered no UCX worker address")
        if chosen is Transport.UCX and ucx_tag_base == 0:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "ucx_tag_base must be a random nonzero 64-bit value")
        return chosen, engine.link if chosen is Transport.UCX else None

    async def pull_messages(self, request: pb.PullRequest):
        """The messages of one pull of ``request``, as a Pull stream sends them; StatusError for a pull
        refused or failed (the status its stream ends with). Closing the generator early stops its sends."""
        grant, transport, link = self.checked(request)
        plan = served_plan(self.layout, grant, request.regions)
        hops.stamp(grant.grant_id, "checked")
        views = [regions.region_view(self.pool, region) for region in plan.regions]
        async with contextlib.aclosing(self.serve(grant, plan, views, transport=transport, engine_id=request.engine_id,
                                                  link=link, tag_base=request.ucx_tag_base,
                                                  integrity=request.integrity)) as messages:
            async for message in messages:
                yield message

    async def serve(self, grant: Grant, plan, views, *, transport: Transport, engine_id: str, link: UcxLink | None,
                    tag_base: int, integrity: bool, first: pb.PullResponse | None = None, abandon_if_left: bool = False):
        """The messages of a checked pull of ``grant``: ``plan`` (its regions and when each may move) read from
        ``views`` (a region's tensor, or a callable that gathers it once written). ``first`` (a push's grant)
        goes out once the UCX sends that may move have been posted, so that its write delays none of them. The
        pull keeps the grant from being freed until it ends. A caller that leaves before PullDone abandons the
        grant if its prompt is still computing, or always with ``abandon_if_left`` (a push: nobody pulls it
        again)."""
        grant.pulls_in_flight += 1
        started = time.perf_counter()
        outbound = OutboundPull(grant, plan, views, transport=transport, engine_id=engine_id,
                                link=link, tag_base=tag_base, chunk_bytes=self.config.chunk_bytes,
                                integrity=integrity,
                                deadline=time.monotonic() + self.config.pull_budget_s(computing=grant.computing))
        finished = caller_left = False
        try:
            try:
                if first is not None:
                    await outbound.begin()
                    yield first
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
                logger.warning("pull of grant %s by %s ended before its last byte", grant.grant_id, engine_id)
            grant.pulls_in_flight -= 1
            if caller_left and not finished and (grant.computing or abandon_if_left):  # its decode engine went away
                self.grants.abandon(grant, f"its pull by {engine_id} ended before the prompt was computed"
                                    if grant.computing else f"its push to {engine_id} ended before its last byte")
            self.grants.reap()
