"""PrefillPeer: one prefill node as a decode node sees it after a Handshake; the calls it makes to
that node (Prefill, Pull, Release, Heartbeat), each with a deadline, each failure a StatusError."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.compat import arrangement
from kpool_pd.connector.shared.errors import StatusError, rpc_failure
from kpool_pd.connector.decode.grant import PrefillGrant, TransferTimes, grant_from
from kpool_pd.connector.decode.landed import LandedRequest
from kpool_pd.connector.decode.inbound import InboundPull, Landing
from kpool_pd.connector.decode.keep_alive import KeepAlive
from kpool_pd.connector.decode.peer_context import PeerContext
from kpool_pd.connector.decode.peer_releases import PeerReleases
from kpool_pd.connector.shared.pull_frames import pull_method, push_method
from kpool_pd.connector.decode.pull_session import PullSession
from kpool_pd.connector.decode.push import can_push, plan_push
from kpool_pd.connector.decode.share import WHOLE_REQUEST, PullShare, PullTarget
from kpool_pd.connector.decode.staging import BlocksReady, RepackStaging
from kpool_pd.connector.shared.wire import Transport, region_message, transports_from
from kpool_pd.kvcache import BlockLayout, CacheAllocation

logger = logging.getLogger(__name__)


class PrefillPeer(PeerReleases):
    """One prefill node, after a successful Handshake. Made by ``DecodeConnector.connect`` with the
    node's ``PeerContext``; closed by ``DecodeConnector.disconnect`` (or ``close``). ``layout`` is the
    peer's block layout: ours, or ours arranged otherwise (block size, order, kernel page; then
    ``repacks`` is True).

    The peer runs one liveness loop (``keep_alive``, ``kpool_pd.connector.decode.keep_alive``): a Heartbeat every
    ``heartbeat_interval_s`` (at most a third of the prefill node's lease) renewing the grants it is
    pulling, and a new Handshake when the prefill node says it forgot this engine; it ends with the peer.

    A caller cancelled while it waits on this node leaves the node no grant to expire: a Prefill
    is cancelled (or, if it was granted already, its grant released); a pull retires its receives
    and releases its grant in the background (``release_soon``, which sends the Release again until
    the node answers it or the grant's lease has run out)."""

    def __init__(self, context: PeerContext, address: str, channel: grpc.aio.Channel,
                 response: pb.HandshakeResponse, layout: BlockLayout, *, handshake: pb.HandshakeRequest) -> None:
        self.context = context
        self.address = address
        self.engine_id = response.engine_id
        self.layout = layout
        self.repacks = layout.layout_hash != context.pool.layout.layout_hash
        # where its blocks land before the repack, kept from one pull to the next
        self.staging = RepackStaging(layout, context.pool.device) if self.repacks else None
        self.closed = False
        self.transports = transports_from(response.transports)
        self._channel = channel
        self._stub = pb.PrefillServiceStub(channel)
        self._pull = pull_method(channel)  # reads chunks without protobuf's copies
        self._push = push_method(channel)
        self.pushes = response.push and can_push(context.pool.layout, layout)  # it serves PrefillPush for our layout
        self.piece_tokens = response.piece_tokens or context.config.piece_tokens  # a push's pieces: the node's steps
        # UCX pulls go on one stream kept open to the node, where it serves one (a new call per pull costs more)
        self._session = PullSession(self._stub.PullSession, address,
                                    idle_s=response.pull_session_idle_ms / 1000 or None,
                                    batches=response.pull_batches) \
            if response.pull_session else None
        self._calls = 0  # Prefill, Pull and Release calls in flight (background ones included)
        self._open_grants: dict[str, float] = {}  # granted, not yet pulled or released -> lease end (monotonic)
        self._background: set[asyncio.Task] = set()  # calls whose caller was cancelled; ``close`` cancels them
        self._releasing: set[asyncio.Task] = set()  # background Releases queued here (the connector's: see release_soon)
        self._pulling: Counter[str] = Counter()  # grants being pulled (the keep-alive renews them)
        lease_s = response.lease_ms / 1000 or context.config.lease_s
        self.lease_s = lease_s  # the node's lease: a grant nobody renews is freed by then
        self.keep_alive = KeepAlive(self._stub, handshake, context.config, context.secrets, address=address,
                                    period_s=min(context.config.heartbeat_interval_s, lease_s / 3),
                                    grants=lambda: list(self._pulling))
        self.keep_alive.start()

    @property
    def busy(self) -> bool:
        """True while a Prefill or Pull is in flight or a grant it returned is neither pulled nor
        released (until that grant's lease ran out): the peer should not be closed yet."""
        now = time.monotonic()
        self._open_grants = {g: end for g, end in self._open_grants.items() if end > now}
        return self._calls > 0 or bool(self._releasing) or bool(self._open_grants)

    @contextlib.contextmanager
    def _call(self):
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1

    @property
    def _secret(self) -> bytes:
        """This engine's secret on the prefill node (its latest Handshake's), which every call presents."""
        return self.context.secrets.get(self.address)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"{what}: peer {self.address} was disconnected")

    # control calls ---------------------------------------------------------------------------
    async def prefill(self, request_id: str, prompt_token_ids, *, pipelined: bool = False,
                      dcp_engine_ids: tuple[str, ...] = (), dcp_interleave: int = 0,
                      mrope_positions: Sequence[Sequence[int]] = ()) -> PrefillGrant:
        """Run the prompt on the prefill node; the grant holds its blocks there under lease until
        pulled and released. StatusError with the node's status (within ``rpc_timeout_s``).

        ``pipelined``: the node answers once it allocated the blocks (a node that does not pipeline
        answers after the prompt: ``grant.pipelined`` says which); ``pull`` then moves the blocks as the
        prompt's chunks complete them and brings the first token (``LandedRequest.first_token``).

        Cancelling the caller cancels the call (the node stops the prefill and frees its blocks);
        if the answer had already come, the grant it names is released at once in the background,
        so that no grant nobody knows of holds the node's blocks until its lease runs out. (An
        answer still on the wire when the cancel leaves is lost; its lease frees it.)

        A DCP decode instance names its ranks' engine ids (``dcp_engine_ids``, this connector's
        first) and its interleave: each rank then pulls and releases its own share. ``mrope_positions``: the
        prompt's (time, height, width) a token, or () for text (the prefill node's engine checks them)."""
        req = pb.PrefillRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                                engine_id=self.context.engine_id, engine_secret=self._secret, pipelined=pipelined,
                                dcp_engine_ids=list(dcp_engine_ids), dcp_interleave=dcp_interleave,
                                mrope_positions=[v for p in mrope_positions for v in p])
        self._check_open(f"Prefill of {request_id}")
        call = asyncio.ensure_future(self._prefill_call(req))
        try:
            r = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.cancel()  # no-op when the answer is already here: then its grant is released
            self._background.add(call)
            call.add_done_callback(self._release_abandoned)
            raise
        self._open_grants[r.grant_id] = time.monotonic() + r.lease_ms / 1000
        if len(r.src_block_ids) != r.num_blocks:
            self.release_soon(r.grant_id)
            raise StatusError(grpc.StatusCode.INTERNAL, f"Prefill of {request_id} on {self.address} named "
                              f"{len(r.src_block_ids)} source blocks for a grant of {r.num_blocks}")
        return grant_from(r)

    async def _prefill_call(self, req: pb.PrefillRequest) -> pb.PrefillResponse:
        try:
            with self._call():
                return await self._stub.Prefill(req, timeout=self.context.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_failure(exc, f"Prefill of {req.request_id} on {self.address}") from None

    def _follow_on(self, stream: asyncio.Task) -> None:
        """Keep a landed pull's stream (``InboundPull._land_on_receives``) until it ends; ``close``
        cancels it. A failure after the bytes landed is logged, not raised: nobody waits on it."""
        self._background.add(stream)

        def ended(task: asyncio.Task) -> None:
            self._background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                logger.warning("the Pull stream from %s failed after its bytes landed: %s", self.address,
                               task.exception())
        stream.add_done_callback(ended)

    async def heartbeat(self, grant_ids) -> list[str]:
        """Renew leases; returns the ids the prefill node no longer holds."""
        self._check_open("Heartbeat")
        try:
            r = await self._stub.Heartbeat(pb.HeartbeatRequest(engine_id=self.context.engine_id, grant_ids=list(grant_ids),
                                                               engine_secret=self._secret),
                                           timeout=self.context.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rpc_failure(exc, f"Heartbeat to {self.address}") from None
        return list(r.unknown_grant_ids)

    # the pull --------------------------------------------------------------------------------
    async def pull(self, grant: PrefillGrant, *, into: CacheAllocation, transport: Transport | None = None,
                   integrity: bool = False, release: bool = True, share: PullShare = WHOLE_REQUEST,
                   held: Sequence[int] = ()) -> LandedRequest:
        """Land the request's prompt into the first blocks of ``into`` (an allocation of this node's cache
        that the caller made and keeps: the connector never allocates) and its ring into ``into``'s ring,
        through staging when the peer's layout is arranged otherwise (block size, order, kernel page),
        verify (``integrity``: crc32 per region, DATA_LOSS on a mismatch) and Release the grant (unless
        ``release`` is False). A pipelined grant's pull starts before its prompt is computed: the receives
        are posted at once, the pieces land as the prefill node's chunks complete them, and the deadline
        adds ``rpc_timeout_s`` (the compute's) to ``transfer_timeout_s``; a prefill node that fails or
        dies meanwhile fails the pull (INTERNAL, UNAVAILABLE).

        Who calls: the decode node's scheduler (or a DCP rank), from the connector's event loop, any
        number at once, each into its own allocation. Failure: StatusError within ``transfer_timeout_s``
        (plus ``rpc_timeout_s`` for a pipelined grant); the grant is then the caller's to release.
        Cancelling the call gives the grant back at once unless ``release`` is False (the Release is
        sent in the background). Whichever way it ends, no receive into ``into`` is posted any more when
        it returns or raises, so the caller may release the allocation at once; the bytes of a failed
        pull are garbage. ValueError (before anything is sent) for an allocation that is released,
        has no ring, is of another cache, or has fewer blocks than the prompt lands in.

        ``share``: what of the grant this pull lands (``kpool_pd.connector.decode.share``): the whole request, or
        this connector's share as a rank of a DCP decode instance named in the grant's Prefill (its own tokens
        into the first blocks of its allocation; the Release releases its share only; FAILED_PRECONDITION for a
        peer whose layout is not ours).

        ``held``: block-table indices (increasing) of the grant's blocks whose bytes ``into`` holds already at
        the same index (a prefix-cache hit): they are not pulled; the rest and the ring are. Needs the peer's
        layout equal to ours, a computed prompt and the whole request (ValueError otherwise)."""
        ours = self.context.pool.layout
        held = tuple(held)
        share.check(grant, ours=ours, peer_layout=self.layout, held=held, address=self.address)
        landed = share.blocks_landed(ours, grant)
        ringless = isinstance(into, CacheAllocation) and into.ring_id is None and self.context.pool.layout.ring_slots > 0
        if not isinstance(into, CacheAllocation) or into.released or ringless \
                or into.pool is not self.context.pool or into.num_blocks < landed:
            raise ValueError(f"pull of {grant.request_id} needs a held allocation of this node's cache with a ring "
                             f"and at least {landed} blocks, got {into!r}")
        with self._call():
            try:
                return await self._pull_and_release(grant, into, transport, integrity, release, share, held)
            finally:
                self._open_grants.pop(grant.grant_id, None)

    async def push(self, request_id: str, prompt_token_ids, *, into: CacheAllocation,
                   transport: Transport | None = None, integrity: bool = False,
                   mrope_positions: Sequence[Sequence[int]] = (),
                   on_granted: Callable[[PrefillGrant], None] | None = None) -> LandedRequest:
        """Prefill and pull in one call (PrefillPush), for a node that serves it (``pushes``): the receives into
        ``into`` (held by the caller, as for ``pull``) are posted and the plan sent with the prompt, so the prefill
        node sends each piece from the end of the chunk that wrote it, with no message from here after the
        prompt; returns once every byte landed, with the first token. The grant (``LandedRequest.grant``) is then
        the caller's to release, as after ``pull(release=False)``; a push that fails after the node granted it
        releases it (waiting up to ``rpc_timeout_s`` for a node that is up), a cancelled one in the background
        (the node also frees it when the call ends early). Failure:
        StatusError within ``pull_budget_s(computing=True)``, the node's status for a refused or failed prompt;
        no receive into ``into`` is posted any more when it returns or raises. ValueError (nothing sent) for an
        allocation as ``pull`` refuses, or a peer that does not push. ``on_granted(grant)`` is called once the
        node has granted the prompt's blocks (its bytes are then moving, or wait for the chunks that write them)."""
        n = len(prompt_token_ids)
        if not self.pushes:
            raise ValueError(f"prefill node {self.address} takes no push for this layout: use prefill and pull")
        if not isinstance(into, CacheAllocation) or into.released or into.pool is not self.context.pool \
                or (into.ring_id is None and self.context.pool.layout.ring_slots > 0):
            raise ValueError(f"push of {request_id} needs a held allocation of this node's cache with a ring, "
                             f"got {into!r}")
        c = self.context
        grant, landing, plan = plan_push(c.pool, self.layout, into, request_id=request_id, prompt_len=n,
                                         lease_s=self.lease_s, piece_tokens=self.piece_tokens, buffers=self.staging)
        self._check_open(f"PrefillPush of {request_id}")
        transport = self._transport_for(transport)
        tag_base = InboundPull.tag_base_for(transport)
        req = pb.PushRequest(prefill=pb.PrefillRequest(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), engine_id=c.engine_id,
            engine_secret=self._secret, pipelined=True, mrope_positions=[v for p in mrope_positions for v in p]),
            transport=transport.value, integrity=integrity, ucx_tag_base=tag_base,
            regions=[region_message(pair.src) for pair in plan.pairs])
        budget = c.config.pull_budget_s(computing=True)
        granted: list[str] = []

        def granted_here(made: PrefillGrant) -> None:
            granted.append(made.grant_id)
            self._pulling[made.grant_id] += 1  # the keep-alive renews its lease while it moves
            if on_granted is not None:
                on_granted(made)

        pull = InboundPull(lambda: self._push(req, timeout=budget), address=self.address, grant=grant, landing=landing,
                           ring_id=0 if into.ring_id is None else into.ring_id, transport=transport, tag_base=tag_base,
                           integrity=integrity, ucx=c.ucx, metrics=c.metrics, keep=self._follow_on, plan=plan,
                           on_granted=granted_here)
        started = time.perf_counter()
        with self._call():
            try:
                await asyncio.wait_for(pull.run(), budget)
            except BaseException as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    exc = StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"did not finish in {budget} s")
                c.metrics.failures.labels(exc.code.name.lower() if isinstance(exc, StatusError)
                                          else type(exc).__name__).inc()
                if not isinstance(exc, StatusError):  # cancelled: the grant goes back in the background
                    for grant_id in granted:
                        self.release_soon(grant_id)
                    raise
                for grant_id in granted:  # a node that is up frees its blocks now, not at the lease's end
                    if exc.code is grpc.StatusCode.UNAVAILABLE:
                        self.release_soon(grant_id)
                    else:
                        await self.release_within(grant_id, c.config.rpc_timeout_s)
                raise StatusError(exc.code, f"push of {request_id} to {self.address}: {exc.message}") from None
            finally:
                for grant_id in granted:
                    self._pulling[grant_id] -= 1
                    if self._pulling[grant_id] <= 0:
                        del self._pulling[grant_id]
        return self._landed(pull, transport, time.perf_counter() - started)

    def _transport_for(self, asked: Transport | None) -> Transport:
        """The transport asked for, else UCX when both sides have it; FAILED_PRECONDITION if unavailable."""
        ucx = self.context.ucx
        both_ucx = Transport.UCX in self.transports and ucx is not None
        transport = asked or (Transport.UCX if both_ucx else Transport.GRPC_STREAM)
        if transport not in self.transports or (transport is Transport.UCX and ucx is None):
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"transport {transport.label} not available with {self.address}")
        return transport

    async def _pull_and_release(self, grant: PrefillGrant, allocation: CacheAllocation, transport: Transport | None,
                                integrity: bool, release: bool, share: PullShare,
                                held: tuple[int, ...]) -> LandedRequest:
        c = self.context
        self._check_open(f"Pull of {grant.request_id}")
        transport = self._transport_for(transport)
        started = time.perf_counter()
        self._pulling[grant.grant_id] += 1  # the keep-alive renews its lease while it is pulled
        budget = c.config.pull_budget_s(computing=grant.pipelined)
        try:
            pull = await asyncio.wait_for(self._land(grant, allocation, transport, integrity, share, held), budget)
        except BaseException as exc:
            cause = exc.code.name.lower() if isinstance(exc, StatusError) else type(exc).__name__
            c.metrics.failures.labels(cause).inc()
            if release and isinstance(exc, asyncio.CancelledError):
                self.release_soon(grant.grant_id, dcp_rank=share.rank)
            if isinstance(exc, asyncio.TimeoutError):
                raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"pull of {grant.request_id} from {self.address} "
                                  f"did not finish in {budget} s") from None
            raise
        finally:
            self._pulling[grant.grant_id] -= 1
            if self._pulling[grant.grant_id] <= 0:
                del self._pulling[grant.grant_id]
        landed = self._landed(pull, transport, time.perf_counter() - started, held_blocks=len(held))
        if release:  # a failed Release is tried again in the background: the data has landed
            await self.release_within(grant.grant_id, c.config.rpc_timeout_s, dcp_rank=share.rank)
        return landed

    def _landed(self, pull: InboundPull, transport: Transport, seconds: float, *, held_blocks: int = 0) -> LandedRequest:
        """How a finished pull (or push) landed, counted in the metrics."""
        c, grant = self.context, pull.grant
        c.metrics.transferred(transport.label, pull.plan.total_bytes, len(pull.plan), seconds)
        times = pull.times or TransferTimes(prefill_ms=grant.prefill_ms, transfer_ms=seconds * 1000,
                                            exposed_transfer_ms=seconds * 1000)
        landed = LandedRequest(grant=grant, transport=transport, nbytes=pull.plan.total_bytes, regions=len(pull.plan),
                               seconds=seconds, repacked=self.repacks, timeline=pull.timeline,
                               first_token=pull.first_token, times=times, prompt_blocks=len(pull.landing.block_ids),
                               held_blocks=held_blocks, ready=pull.ready or BlocksReady.NOW)
        c.metrics.request_times(landed.times)
        logger.debug("pulled %s from %s: %d B in %d regions over %s in %.2f ms (%s)", grant.request_id, self.address,
                     landed.nbytes, landed.regions, transport.label, seconds * 1000, pull.timeline)
        return landed

    async def _land(self, grant: PrefillGrant, allocation: CacheAllocation, transport: Transport,
                    integrity: bool, share: PullShare, held: tuple[int, ...]) -> InboundPull:
        """Plan the pull once (``share``'s plan, from the grant), send the plan's source side in the PullRequest
        (the prefill node checks it against the grant and serves it as it is), and land the prompt (a DCP rank:
        its share) into the first blocks of the allocation; the finished pull (its plan and timeline)."""
        c = self.context
        ring_id = 0 if allocation.ring_id is None else allocation.ring_id  # a ringless layout's: names nothing
        landing = Landing(c.pool, self.layout, allocation.block_ids[:share.blocks_landed(c.pool.layout, grant)],
                          source_blocks=len(grant.src_block_ids), num_tokens=grant.prompt_len, buffers=self.staging)
        target = PullTarget(layout=c.pool.layout, peer_layout=self.layout, block_ids=landing.ids, ring_id=ring_id,
                            num_blocks=landing.num_blocks, num_rings=c.pool.num_rings)
        try:
            plan = share.plan(grant, target, held)
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INTERNAL, f"bad plan from {self.address}: {exc}") from None
        tag_base = InboundPull.tag_base_for(transport)
        req = pb.PullRequest(grant_id=grant.grant_id, engine_id=c.engine_id, engine_secret=self._secret,
                             transport=transport.value, integrity=integrity, ucx_tag_base=tag_base,
                             dcp_rank=share.rank, regions=[region_message(pair.src) for pair in plan.pairs])
        deadline_s = c.config.pull_budget_s(computing=grant.pipelined)
        session = self._session if transport is Transport.UCX and self._session is not None else None
        pull = InboundPull((lambda: session.open(req)) if session is not None else
                           (lambda: self._pull(req, timeout=deadline_s)),
                           address=self.address, grant=grant, landing=landing, ring_id=ring_id,
                           transport=transport, tag_base=tag_base, integrity=integrity, ucx=c.ucx, metrics=c.metrics,
                           keep=self._follow_on, plan=plan)
        await pull.run()
        return pull

    async def close(self) -> None:
        """Close the channel (idempotent); calls in flight on it fail with CANCELLED, abandoned
        Prefills are cancelled. Background Releases go on through the connector (``release_soon``)."""
        self.closed = True
        await self.keep_alive.stop()
        for task in list(self._background):
            task.cancel()
        if self._session is not None:
            self._session.close()
        await self._channel.close()

    def __repr__(self) -> str:
        return (f"PrefillPeer({self.address!r}, engine={self.engine_id!r}, "
                f"{'repacks from ' + arrangement(self.layout) if self.repacks else 'same layout'}"
                f"{', closed' if self.closed else ''})")
