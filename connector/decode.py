"""DecodeConnector: the decode node's side. It handshakes with prefill nodes, asks them to
prefill, allocates blocks and a ring in its own pool, pulls the request into them over UCX or
the gRPC stream, verifies, and releases the grant.

Every call that waits on a peer has a deadline (``rpc_timeout_s``, ``transfer_timeout_s``);
every failure is a ``StatusError`` carrying a gRPC status code, and leaves nothing allocated.

A prefill node whose layout differs from ours only in ``order`` is accepted: its blocks land in
a staging buffer sized to the request and ``kernels.repack_blocks`` converts them into our
blocks (the ring has no head axis and lands directly). With equal layouts the bytes land in
our blocks with no staging copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass

import grpc
import torch
from prometheus_client import CollectorRegistry

from connector._generated.kpoolpd.v1 import prefill_pb2 as pb
from connector._generated.kpoolpd.v1 import prefill_pb2_grpc as pb_grpc
from connector.auth import auth_metadata
from connector.channels import open_channel
from connector.compat import peer_layout
from connector.config import ConnectorConfig
from connector.engine import SamplingParams
from connector.errors import StatusError
from connector.metrics import ConnectorMetrics
from connector.plan import PoolKind, RingRange, TransferPlan, plan_transfer
from connector.regions import crc32, region_view, write_bytes
from connector.ucx import MAX_REGIONS, ReceiveBatch, UcxNode
from connector.wire import Transport, layout_message, ring_from
from kernels import repack_blocks
from kvcache import BlockAllocator, BlockLayout, CachePool, RingAllocator

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PrefillGrant:
    """What a Prefill call returned: the grant to pull, and what the decode node allocates."""

    grant_id: str
    request_id: str
    prompt_len: int
    num_blocks: int
    ring_live: RingRange
    first_token: int
    lease_s: float


class LandedRequest:
    """A request's blocks and ring in the decode node's pool, filled by a pull.

    Owns them until ``release()`` (idempotent) frees them; a context manager. ``__del__`` only
    reports a leak."""

    __slots__ = ("grant", "block_ids", "ring_id", "transport", "nbytes", "regions", "seconds", "repacked",
                 "_connector", "_released")

    def __init__(self, connector: "DecodeConnector", grant: PrefillGrant, block_ids: tuple[int, ...], ring_id: int,
                 transport: Transport, nbytes: int, regions: int, seconds: float, repacked: bool = False) -> None:
        self.grant, self.block_ids, self.ring_id = grant, block_ids, ring_id
        self.transport, self.nbytes, self.regions, self.seconds = transport, nbytes, regions, seconds
        self.repacked = repacked  # landed in a staging buffer and converted from the peer's block order
        self._connector = connector
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._connector._free(self.grant.request_id, self.block_ids)

    def __enter__(self) -> "LandedRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            logger.error("LandedRequest %s was never released: %d blocks leak", self.grant.request_id, len(self.block_ids))

    def __repr__(self) -> str:
        return (f"LandedRequest({self.grant.request_id!r}, blocks={len(self.block_ids)}, ring={self.ring_id}, "
                f"{self.nbytes} B in {self.regions} regions over {self.transport.label}, "
                f"{'released' if self._released else 'held'})")


def _status(exc: grpc.aio.AioRpcError, what: str) -> StatusError:
    return StatusError(exc.code(), f"{what}: {exc.details()}")


class PrefillPeer:
    """One prefill node, after a successful Handshake. Made by ``DecodeConnector.connect``;
    closed by ``DecodeConnector.disconnect`` (or ``close``). ``layout`` is the peer's block
    layout: ours, or ours in the other ``order`` (then ``repacks`` is True)."""

    def __init__(self, connector: "DecodeConnector", address: str, channel: grpc.aio.Channel,
                 response: pb.HandshakeResponse, layout: BlockLayout) -> None:
        self.connector = connector
        self.address = address
        self.engine_id = response.engine_id
        self.layout = layout
        self.repacks = layout.layout_hash != connector.pool.layout.layout_hash
        self.closed = False
        self.transports = tuple(Transport(t) for t in response.transports if t in {x.value for x in Transport})
        self.lease_s = response.lease_ms / 1000
        self._channel = channel
        self._stub = pb_grpc.PrefillServiceStub(channel)
        self._calls = 0  # Prefill and Pull calls in flight
        self._open_grants: dict[str, float] = {}  # granted, not yet pulled or released -> lease end (monotonic)

    @property
    def busy(self) -> bool:
        """True while a Prefill or Pull is in flight or a grant it returned is neither pulled nor
        released (until that grant's lease ran out): the peer should not be closed yet."""
        now = time.monotonic()
        self._open_grants = {g: end for g, end in self._open_grants.items() if end > now}
        return self._calls > 0 or bool(self._open_grants)

    @contextlib.contextmanager
    def _call(self):
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1

    @property
    def _md(self):
        return auth_metadata(self.connector.config.bearer_token)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"{what}: peer {self.address} was disconnected")

    async def prefill(self, request_id: str, prompt_token_ids, sampling: SamplingParams = SamplingParams()) -> PrefillGrant:
        req = pb.PrefillRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                                sampling=pb.SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, seed=sampling.seed))
        self._check_open(f"Prefill of {request_id}")
        try:
            with self._call():
                r = await self._stub.Prefill(req, timeout=self.connector.config.rpc_timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            raise _status(exc, f"Prefill of {request_id} on {self.address}") from None
        self._open_grants[r.grant_id] = time.monotonic() + r.lease_ms / 1000
        return PrefillGrant(grant_id=r.grant_id, request_id=r.request_id, prompt_len=r.prompt_len, num_blocks=r.num_blocks,
                            ring_live=ring_from(r.ring_live), first_token=r.first_token, lease_s=r.lease_ms / 1000)

    async def release(self, grant_id: str) -> bool:
        """Idempotent: False when the grant was already released or expired."""
        self._open_grants.pop(grant_id, None)
        self._check_open(f"Release of {grant_id}")
        try:
            r = await self._stub.Release(pb.ReleaseRequest(grant_id=grant_id), timeout=self.connector.config.rpc_timeout_s,
                                         metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            raise _status(exc, f"Release of {grant_id} on {self.address}") from None
        return r.released

    async def heartbeat(self, grant_ids) -> list[str]:
        """Renew leases; returns the ids the prefill node no longer holds."""
        self._check_open("Heartbeat")
        try:
            r = await self._stub.Heartbeat(pb.HeartbeatRequest(engine_id=self.connector.engine_id, grant_ids=list(grant_ids)),
                                           timeout=self.connector.config.rpc_timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            raise _status(exc, f"Heartbeat to {self.address}") from None
        return list(r.unknown_grant_ids)

    async def pull(self, grant: PrefillGrant, *, transport: Transport | None = None, integrity: bool = False,
                   release: bool = True) -> LandedRequest:
        """Allocate ``grant.num_blocks`` blocks and a ring, pull the request into them, verify
        (``integrity``: crc32 per region, DATA_LOSS on a mismatch) and Release the grant.
        On any failure the allocation is freed and StatusError raised, within
        ``transfer_timeout_s`` (plus ``rpc_timeout_s`` for the allocation-free Release)."""
        with self._call():
            try:
                return await self._pull_and_release(grant, transport, integrity, release)
            finally:
                self._open_grants.pop(grant.grant_id, None)

    async def _pull_and_release(self, grant: PrefillGrant, transport: Transport | None, integrity: bool,
                                release: bool) -> LandedRequest:
        c = self.connector
        self._check_open(f"Pull of {grant.request_id}")
        transport = transport or (Transport.UCX if Transport.UCX in self.transports and c.ucx is not None else Transport.GRPC_STREAM)
        if transport not in self.transports or (transport is Transport.UCX and c.ucx is None):
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"transport {transport.label} not available with {self.address}")
        block_ids, ring_id = c._allocate(grant)
        started = time.perf_counter()
        heartbeat = asyncio.create_task(self._renew(grant.grant_id))
        try:
            plan = await asyncio.wait_for(self._pull(grant, block_ids, ring_id, transport, integrity), c.config.transfer_timeout_s)
        except BaseException as exc:
            c._free(grant.request_id, block_ids)
            cause = exc.code.name.lower() if isinstance(exc, StatusError) else type(exc).__name__
            c.metrics.failures.labels(cause).inc()
            if isinstance(exc, asyncio.TimeoutError):
                raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"pull of {grant.request_id} from {self.address} did not finish in {c.config.transfer_timeout_s} s") from None
            raise
        finally:
            heartbeat.cancel()
        seconds = time.perf_counter() - started
        c.metrics.transferred(transport.label, plan.total_bytes, len(plan), seconds)
        landed = LandedRequest(c, grant, block_ids, ring_id, transport, plan.total_bytes, len(plan), seconds, self.repacks)
        if release:
            try:
                await self.release(grant.grant_id)
            except StatusError as exc:  # the lease frees it; the data has landed
                logger.warning("release of %s failed (%s); its lease will free it", grant.grant_id, exc)
        return landed

    async def _renew(self, grant_id: str) -> None:
        while True:
            await asyncio.sleep(self.connector.config.heartbeat_interval_s)
            with contextlib.suppress(StatusError):
                await self.heartbeat([grant_id])

    async def _pull(self, grant: PrefillGrant, block_ids, ring_id, transport: Transport, integrity: bool) -> TransferPlan:
        c = self.connector
        tag_base = (secrets.randbits(64) | 1) if transport is Transport.UCX else 0
        # With the peer's block order differing from ours, its blocks land in staging block i
        # (i = 0..n-1, the peer's byte order) and are converted into block_ids[i] at the end.
        staging = (torch.empty(len(block_ids), c.pool.layout.block_bytes, dtype=torch.uint8, device=c.pool.device)
                   if self.repacks else None)
        landing_ids = tuple(range(len(block_ids))) if staging is not None else block_ids
        req = pb.PullRequest(grant_id=grant.grant_id, engine_id=c.engine_id, dst_block_ids=landing_ids, dst_ring_id=ring_id,
                             transport=transport.value, integrity=integrity, ucx_tag_base=tag_base)
        call = self._stub.Pull(req, timeout=c.config.transfer_timeout_s, metadata=self._md)
        receives: ReceiveBatch | None = None
        landed_all = False
        try:
            first = await self._read(call)
            if first is None or first.WhichOneof("message") != "grant":
                raise StatusError(grpc.StatusCode.INTERNAL, "Pull stream did not start with a grant")
            g = first.grant
            if ring_from(g.ring_live) != grant.ring_live or len(g.src_block_ids) != len(block_ids):
                raise StatusError(grpc.StatusCode.INTERNAL, "Pull grant disagrees with the Prefill response")
            plan = plan_transfer(c.pool.layout, list(g.src_block_ids), list(landing_ids), g.src_ring_id, ring_id,
                                 grant.ring_live, dst_num_blocks=len(landing_ids) if staging is not None else c.pool.num_blocks,
                                 dst_num_rings=c.pool.num_rings)
            if len(plan) != g.num_regions or plan.total_bytes != g.total_bytes or len(plan) > MAX_REGIONS:
                raise StatusError(grpc.StatusCode.INTERNAL, f"plan of {len(plan)} regions / {plan.total_bytes} B disagrees "
                                    f"with the grant's {g.num_regions} / {g.total_bytes}")
            views = [region_view(c.pool, p.dst, blocks=staging if p.dst.kind is PoolKind.BLOCKS else None)
                     for p in plan.pairs]
            if transport is Transport.UCX:
                receives = c.ucx.post_receives(views, tag_base)
            landed = [0] * len(views)
            while True:
                msg = await self._read(call)
                if msg is None:
                    raise StatusError(grpc.StatusCode.UNAVAILABLE, "Pull stream ended without PullDone")
                kind = msg.WhichOneof("message")
                if kind == "chunk":
                    ch = msg.chunk
                    if transport is not Transport.GRPC_STREAM or ch.region >= len(views) or ch.offset != landed[ch.region] \
                            or ch.offset + len(ch.data) > views[ch.region].numel():
                        raise StatusError(grpc.StatusCode.INTERNAL, f"unexpected chunk (region {ch.region}, offset {ch.offset})")
                    self._apply_chunk(views[ch.region][ch.offset:ch.offset + len(ch.data)], ch.data)
                    landed[ch.region] += len(ch.data)
                elif kind == "done":
                    done = msg.done
                    break
                else:
                    raise StatusError(grpc.StatusCode.INTERNAL, f"unexpected {kind} message in a Pull stream")
            if receives is not None:
                await receives.wait()
                landed_all = True
            elif landed != [v.numel() for v in views]:
                raise StatusError(grpc.StatusCode.DATA_LOSS, f"stream ended with {sum(landed)} of {plan.total_bytes} bytes")
            if integrity:
                got = [crc32(v) for v in views]
                bad = [i for i, (a, b) in enumerate(zip(got, done.crc32)) if a != b]
                if len(done.crc32) != len(views) or bad:
                    raise StatusError(grpc.StatusCode.DATA_LOSS,
                                        f"crc32 mismatch in regions {bad or 'all (none sent)'} of {grant.request_id}")
            if staging is not None:
                repack_blocks(staging, self.layout, landing_ids, c.pool.blocks, c.pool.layout, block_ids)
            return plan
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INTERNAL, f"bad plan from {self.address}: {exc}") from None
        except (StatusError, asyncio.CancelledError, asyncio.TimeoutError):
            raise
        except Exception as exc:  # a UCX failure: the peer is gone or unreachable
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                f"UCX transfer from {self.address} failed: {type(exc).__name__}: {exc}") from None
        finally:
            call.cancel()  # a prefill node still sending drops its endpoint, which cancels its sends
            if receives is not None and not landed_all:
                # Receives into our blocks are posted and the pull failed: retire them before
                # the caller frees the blocks.
                stuck = await c.ucx.abandon(receives)
                if stuck:
                    c.metrics.failures.labels("ucx_receive_abandoned").inc(stuck)
                    logger.warning("pull of %s from %s: %d receives still pending after the sender went away",
                                   grant.request_id, self.address, stuck)
            del staging  # no receive writes into it any more

    def _apply_chunk(self, view, data: bytes) -> None:
        write_bytes(view, data)

    async def _read(self, call):
        try:
            msg = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise _status(exc, f"Pull from {self.address}") from None
        return None if msg is grpc.aio.EOF else msg

    async def close(self) -> None:
        """Close the channel (idempotent); calls in flight on it fail with CANCELLED."""
        self.closed = True
        await self._channel.close()

    def __repr__(self) -> str:
        return (f"PrefillPeer({self.address!r}, engine={self.engine_id!r}, "
                f"{'repacks from ' + self.layout.config.order.value if self.repacks else 'same layout'}"
                f"{', closed' if self.closed else ''})")


class DecodeConnector:
    """The decode node's pool and allocators, its UCX worker, and its peers.

    ``await start()`` (inside the event loop that will run the pulls) makes the UCX worker when
    UCX is among ``transports``; ``connect(address)`` handshakes with one prefill node (each
    call a new channel) and ``disconnect(peer_or_address)`` closes it."""

    def __init__(self, pool: CachePool, blocks: BlockAllocator, rings: RingAllocator, *, engine_id: str,
                 config: ConnectorConfig, registry: CollectorRegistry,
                 transports: tuple[Transport, ...] = (Transport.UCX, Transport.GRPC_STREAM)) -> None:
        self.pool, self.blocks, self.rings = pool, blocks, rings
        self.engine_id = engine_id
        self.config = config
        self.transports = tuple(transports)
        self.metrics = ConnectorMetrics(registry, "decode")
        self.metrics.watch_free(lambda: blocks.num_free, lambda: rings.num_free)
        self.ucx: UcxNode | None = None
        self._peers: list[PrefillPeer] = []

    async def start(self) -> "DecodeConnector":
        if Transport.UCX in self.transports and self.ucx is None:
            self.ucx = UcxNode(self.config.ucx_options)
        return self

    @property
    def peers(self) -> tuple[PrefillPeer, ...]:
        """The connected peers, oldest first."""
        return tuple(self._peers)

    async def connect(self, address: str) -> PrefillPeer:
        """Handshake with the prefill node at ``host:port``. FAILED_PRECONDITION (naming the
        differing layout fields) when the layouts differ in more than ``order``; UNAUTHENTICATED
        without the right token. Each call opens a new channel: a caller that handshakes again
        with the same node calls ``disconnect`` first."""
        channel = open_channel(address, self.config.tls, self.config.grpc_options())
        req = pb.HandshakeRequest(engine_id=self.engine_id, layout=layout_message(self.pool.layout),
                                  transports=[t.value for t in self.transports if t is not Transport.UCX or self.ucx],
                                  ucx_worker_address=self.ucx.address if self.ucx else b"")
        try:
            r = await pb_grpc.PrefillServiceStub(channel).Handshake(
                req, timeout=self.config.rpc_timeout_s, metadata=auth_metadata(self.config.bearer_token))
        except grpc.aio.AioRpcError as exc:
            await channel.close()
            self.metrics.failures.labels(exc.code().name.lower()).inc()
            raise _status(exc, f"Handshake with {address}") from None
        layout, differing = peer_layout(self.pool.layout, r.layout)
        if layout is None:
            await channel.close()
            self.metrics.failures.labels("layout_mismatch").inc()
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"Handshake with {address}: cache layout of prefill node {r.engine_id} differs: fields {differing}")
        peer = PrefillPeer(self, address, channel, r, layout)
        self._peers.append(peer)
        return peer

    async def disconnect(self, peer_or_address: PrefillPeer | str) -> int:
        """Forget a peer, or every peer connected to an address: close its channel (pulls in
        flight on it fail and free their blocks). A router calls it for a node gone from DNS or
        replaced by a new handshake, once ``peer.busy`` is False. Idempotent: returns how many peers it closed (0 when none was connected)."""
        if isinstance(peer_or_address, PrefillPeer):
            gone = [p for p in self._peers if p is peer_or_address]
        elif isinstance(peer_or_address, str):
            gone = [p for p in self._peers if p.address == peer_or_address]
        else:
            raise TypeError(f"disconnect takes a PrefillPeer or a 'host:port' string, got {type(peer_or_address).__name__}")
        self._peers = [p for p in self._peers if all(p is not g for g in gone)]
        for peer in gone:
            await peer.close()
        if gone:
            logger.info("disconnected from %s (%d channel%s)", peer_or_address if isinstance(peer_or_address, str)
                        else peer_or_address.address, len(gone), "" if len(gone) == 1 else "s")
        return len(gone)

    def _allocate(self, grant: PrefillGrant) -> tuple[tuple[int, ...], int]:
        if grant.num_blocks > self.blocks.num_free or self.rings.num_free == 0:
            self.metrics.failures.labels("cache_exhausted").inc()
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"request {grant.request_id} needs {grant.num_blocks} blocks and a ring; free: "
                                f"{self.blocks.num_free} blocks, {self.rings.num_free} rings")
        try:
            ring_id = self.rings.allocate(grant.request_id)
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
        return tuple(self.blocks.allocate(grant.num_blocks)), ring_id

    def _free(self, request_id: str, block_ids) -> None:
        self.blocks.free(list(block_ids))
        self.rings.free(request_id)

    async def close(self) -> None:
        for peer in self._peers:
            await peer.close()
        self._peers.clear()
        if self.ucx is not None:
            self.ucx.close()
