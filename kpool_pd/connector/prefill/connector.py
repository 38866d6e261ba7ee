"""PrefillConnector: the prefill node's gRPC service (Handshake, Prefill, Pull, PullSession, PackedPull,
Release, Heartbeat), wired from one part per concept:

- ``engines`` (``kpool_pd.connector.prefill.decode_engines``): one record per handshaken decode engine (its
  transports, when it was last heard, its UCX link);
- ``HandshakeDesk`` (``kpool_pd.connector.prefill.handshake``): the Handshake, which vets and reaches a new engine;
- ``grants`` (``kpool_pd.connector.prefill.grants``): the grants held under lease, their reaping and freeing,
  Release and Heartbeat;
- ``PrefillDesk`` (``kpool_pd.connector.prefill.prefills``): the Prefill call, the engine's prompt held as a grant;
- ``PullDesk`` (``kpool_pd.connector.prefill.pulls``): each pull checked, planned once and served;
- ``PushDesk`` (``kpool_pd.connector.prefill.pushes``): a Prefill and its pull in one call (PrefillPush);
- ``PackedPullDesk`` (``kpool_pd.connector.prefill.packed_pulls``): one step's pulls as one batch, one message.

Lifecycle: ``add_to_server(server)`` registers the service on the daemon's gRPC server (which owns auth,
TLS, health and reflection); ``await start()`` makes the UCX worker and starts the lease reaper; after
the server stopped, ``await stop()`` cancels the reaper, frees every grant, forgets every engine and
closes UCX (also an async context manager). All state lives on the event loop that called ``start``; the
engine is awaited there.

A node accepts a decode node whose layout arranges the same cache otherwise (block size, order, kernel
page): it sends its blocks as they are and the decode node converts them (see
``kpool_pd.connector.shared.compat``). It refuses one whose model identity differs (``model_identity``, given by
the daemon). The server requires the peer credential on every RPC (``credential``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from prometheus_client import CollectorRegistry

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.decode_engines import DecodeEngineTable
from kpool_pd.connector.prefill.engine import PrefillEngine
from kpool_pd.connector.prefill.grants import GrantKeeper
from kpool_pd.connector.prefill.handshake import HandshakeDesk
from kpool_pd.connector.prefill.leases import LeaseTable
from kpool_pd.connector.prefill.offer_board import MAX_WAIT_S, OfferBoard
from kpool_pd.connector.prefill.outbound import OutboundPull
from kpool_pd.connector.prefill.packed_pulls import PackedPullDesk
from kpool_pd.connector.prefill.prefills import PrefillDesk
from kpool_pd.connector.prefill.pull_session_server import serve_pull_session
from kpool_pd.connector.prefill.pulls import PullDesk
from kpool_pd.connector.prefill.pushes import PushDesk
from kpool_pd.connector.prefill.ucx_vetting import AddressVetting
from kpool_pd.connector.shared import pull_frames
from kpool_pd.connector.shared.auth import Credential
from kpool_pd.connector.shared.compat import MAX_MODEL_IDENTITY_CHARS
from kpool_pd.connector.shared.config import ConnectorConfig, ucx_options_for
from kpool_pd.connector.shared.ucx_progress import progress_mode_for
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.metrics import ConnectorMetrics
from kpool_pd.connector.shared.ucx import NOT_ENCRYPTED, UcxNode
from kpool_pd.connector.shared.wire import Transport
from kpool_pd.kvcache import CacheAllocation, CachePool

logger = logging.getLogger(__name__)


class PrefillConnector(pb.PrefillServiceServicer):
    """Serves one prefill node's cache. Not thread-safe: one event loop."""

    service_name = pb.SERVICE_NAME
    credential = Credential.PEER  # decode nodes' token, never a client's

    def __init__(self, pool: CachePool, engine: PrefillEngine, *,
                 engine_id: str, config: ConnectorConfig, registry: CollectorRegistry,
                 transports: tuple[Transport, ...] = (Transport.UCX, Transport.GRPC_STREAM),
                 model_identity: str = "") -> None:
        if not isinstance(model_identity, str) or len(model_identity) > MAX_MODEL_IDENTITY_CHARS:
            raise ValueError(f"model_identity must be a string of at most {MAX_MODEL_IDENTITY_CHARS} characters")
        if not transports:
            raise ValueError("a prefill node must offer at least one transport")
        self.pool, self.engine, self.engine_id, self.config = pool, engine, engine_id, config
        self.transports = tuple(transports)
        self.metrics = ConnectorMetrics(registry, "prefill")
        self.engines = DecodeEngineTable(config.lease_s)
        self.grants = GrantKeeper(config, self.metrics, self.engines)
        self.handshakes = HandshakeDesk(engine_id=engine_id, layout=pool.layout, model_identity=model_identity,
                                        config=config, transports=self.transports, engines=self.engines,
                                        metrics=self.metrics)
        self.prefills = PrefillDesk(engine_id=engine_id, layout=pool.layout, engine=engine, config=config,
                                    engines=self.engines, grants=self.grants, metrics=self.metrics)
        self.pulls = PullDesk(pool=pool, config=config, transports=self.transports, engines=self.engines,
                              grants=self.grants, metrics=self.metrics)
        self.pushes = PushDesk(pool=pool, prefills=self.prefills, pulls=self.pulls)
        self.packed_pulls = PackedPullDesk(self.pulls)
        self.offer_board = OfferBoard()  # grants held for decode engines named in advance (AwaitOffers)
        self._ucx: UcxNode | None = None
        self._vetting: AddressVetting | None = None
        self.pull_sessions_open = 0  # PullSession calls being served now

    @property
    def model_identity(self) -> str:
        return self.handshakes.model_identity

    @model_identity.setter
    def model_identity(self, value: str) -> None:  # tests play a node of another model
        self.handshakes.model_identity = value

    @property
    def leases(self) -> LeaseTable:
        return self.grants.leases

    @property
    def grants_held(self) -> int:
        """Grants handed out and not yet released or expired (a draining daemon waits for 0)."""
        return len(self.grants)

    @property
    def on_pull_done(self) -> Callable[[OutboundPull], None] | None:
        """Instrumentation (benchmarks): called with each Pull that sent everything, as its stream ends."""
        return self.pulls.on_pull_done

    @on_pull_done.setter
    def on_pull_done(self, hook: Callable[[OutboundPull], None] | None) -> None:
        self.pulls.on_pull_done = hook

    # lifecycle ---------------------------------------------------------------------------
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the PrefillService on ``server`` (the daemon's, which owns auth, TLS and health)."""
        pb.add_to_server(self, server, pull_response_serializer=pull_frames.serialize_response)

    async def start(self) -> None:
        """Make the UCX worker (when UCX is offered) and start the lease reaper; call it on the
        event loop that will serve the RPCs, before the server starts. Idempotent."""
        if Transport.UCX in self.transports and self._ucx is None:
            self._ucx = UcxNode(ucx_options_for(self.config.ucx_options, self.pool.device.type),
                                progress_mode=progress_mode_for(self.config.ucx_progress, self.pool.device.type))
            self._vetting = AddressVetting(self._ucx.options, unified_mode=self._ucx.unified_mode)
            await self._vetting.ready()  # before the server serves: no Handshake waits for the probe's start
            self.handshakes.ucx, self.handshakes.vetting = self._ucx, self._vetting
            if self.config.tls is not None:
                logger.warning(NOT_ENCRYPTED)
        self.grants.start_reaper()
        logger.info("prefill connector %s started (%s)", self.engine_id, ", ".join(t.label for t in self.transports))

    async def stop(self) -> None:
        """Stop the reaper, free every grant, forget every engine (closing their UCX links) and close UCX
        (idempotent). The caller stops the server first, so that no RPC reads the blocks being freed."""
        await self.grants.stop()
        self.engines.close()
        if self._ucx is not None:
            self.handshakes.ucx = self.handshakes.vetting = None
            await self._vetting.stop()
            self._ucx.close()
            self._ucx = self._vetting = None

    async def __aenter__(self) -> "PrefillConnector":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def reap(self) -> int:
        """Free expired and released grants that no pull reads now; returns how many expired."""
        return self.grants.reap()

    def offer(self, allocation: CacheAllocation, *, grant_id: str, request_id: str, prompt_len: int,
              first_token: int = 0) -> None:
        """Hold a prompt the engine computed on its own as a grant (``grant_id``, drawn by the engine:
        ``secrets.token_hex(16)``) under lease, for an engine that schedules its own requests (vLLM's
        producer) instead of answering Prefill calls. The first handshaken decode engine whose Pull, Release
        or Heartbeat names it claims it; from then on it is a grant like any other (lease, Release,
        expiry), and the allocation is released when it ends. Who calls: the engine, on the connector's
        event loop, once per request. ValueError (nothing held: the allocation stays the caller's) for a
        grant id in use, a prompt length out of range, or a released (or, where rings exist, ringless)
        allocation."""
        self.grants.offer(allocation, grant_id=grant_id, request_id=request_id, prompt_len=prompt_len,
                          first_token=first_token)

    # RPCs --------------------------------------------------------------------------------
    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        return await self.handshakes.answer(request, context)

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        try:
            return await self.prefills.answer(request)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)

    async def Pull(self, request: pb.PullRequest, context):
        try:
            async with contextlib.aclosing(self.pull_messages(request)) as messages:  # a cancelled call stops it now
                async for message in messages:
                    yield message
        except StatusError as exc:
            await context.abort(exc.code, exc.message)

    async def PrefillPush(self, request: pb.PushRequest, context):
        """A Prefill and its pull in one call (``kpool_pd.connector.prefill.pushes``)."""
        try:
            async with contextlib.aclosing(self.pushes.push_messages(request)) as messages:
                async for message in messages:
                    yield message
        except StatusError as exc:
            await context.abort(exc.code, exc.message)

    async def PullSession(self, requests, context):
        """One decode node's UCX pulls on one stream (``kpool_pd.connector.prefill.pull_session_server``), ended with
        DEADLINE_EXCEEDED once idle for ``config.pull_session_idle_s``."""
        self.pull_sessions_open += 1
        try:
            async for message in serve_pull_session(requests, self.pull_messages, idle_s=self.config.pull_session_idle_s):
                yield message
        except StatusError as exc:
            await context.abort(exc.code, exc.message)
        finally:
            self.pull_sessions_open -= 1

    async def PackedPull(self, request: pb.PackedPullRequest, context) -> pb.PackedPullResponse:
        """A decode node's pulls of one step as one batch in one UCX message (``kpool_pd.connector.prefill.packed_pulls``)."""
        try:
            return await self.packed_pulls.answer(request)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)

    async def AwaitOffers(self, request: pb.AwaitOffersRequest, context) -> pb.AwaitOffersResponse:
        """The grants held for the calling engine by name since its last call (``offer_board``), waiting up to
        ``wait_ms`` for the first."""
        try:
            self.grants.authenticate(request.engine_id, request.engine_secret, "AwaitOffers")
            if request.wait_ms > MAX_WAIT_S * 1000:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"wait_ms {request.wait_ms}: at most "
                                  f"{int(MAX_WAIT_S * 1000)}")
            taken = await self.offer_board.take(request.engine_id, request.wait_ms / 1000)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)
        return pb.AwaitOffersResponse(offers=[pb.AnnouncedOffer(grant_id=a.key, params_json=a.params_json)
                                              for a in taken])

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        try:
            return self.grants.release(request)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        try:
            return self.grants.heartbeat(request)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)

    def pull_messages(self, request: pb.PullRequest) -> AsyncIterator[pb.PullResponse | bytes]:
        """The messages of one pull (``PullDesk.pull_messages``, an async generator), for tests and tools
        that serve it themselves."""
        return self.pulls.pull_messages(request)
