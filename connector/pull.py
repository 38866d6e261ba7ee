"""The decode side of one Pull stream: from the PullRequest to the prompt's bytes verified in our blocks.

The steps, in order (``InboundPull.run``): open the stream and check its grant against the
Prefill response; plan the regions ourselves and post the UCX receives; land the stream's
chunks (gRPC stream) until PullDone; verify that every byte arrived (and its crc32 when asked);
convert from the peer's block order. Whatever step fails, the stream is cancelled and the
receives posted into our memory are retired before ``run`` returns, so that the caller may free
the blocks at once.

A prefill node whose layout differs from ours only in ``order`` sends its blocks as they are:
they land in a staging buffer sized to the request and ``kernels.repack_blocks`` converts them
into our blocks (the ring has no head axis and lands directly). With equal layouts the bytes
land in our blocks with no staging copy.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import grpc
import torch

import kernels
from connector import prefill_api as pb
from connector import regions
from connector.errors import StatusError, rpc_failure
from connector.landed import PrefillGrant
from connector.metrics import ConnectorMetrics
from connector.plan import PoolKind, RegionPair, TransferPlan, plan_transfer
from connector.ucx import MAX_REGIONS, ReceiveBatch, UcxNode
from connector.wire import Transport, ring_from
from kvcache import BlockLayout, CachePool

logger = logging.getLogger(__name__)


class Landing:
    """Where a pull's blocks land. Equal layouts: straight into ``block_ids`` of our pool. The
    peer's layout in the other order: staging block i (the peer's byte order, i = 0..n-1), which
    ``convert`` repacks into ``block_ids[i]``. ``ids`` are what the PullRequest names."""

    __slots__ = ("pool", "peer_layout", "block_ids", "staging", "ids")

    def __init__(self, pool: CachePool, peer_layout: BlockLayout, block_ids: tuple[int, ...]) -> None:
        self.pool, self.peer_layout, self.block_ids = pool, peer_layout, block_ids
        repacks = peer_layout.layout_hash != pool.layout.layout_hash
        # staging: [len(block_ids), block_bytes] uint8 on the pool's device, or None
        self.staging = (torch.empty(len(block_ids), pool.layout.block_bytes, dtype=torch.uint8, device=pool.device)
                        if repacks else None)
        self.ids = tuple(range(len(block_ids))) if repacks else block_ids

    @property
    def num_blocks(self) -> int:
        """Blocks the landing ids may name (the staging buffer's, else the pool's)."""
        return len(self.ids) if self.staging is not None else self.pool.num_blocks

    def view(self, pair: RegionPair) -> torch.Tensor:
        """uint8 [nbytes]: where the destination region of ``pair`` lands."""
        dst = pair.dst
        return regions.region_view(self.pool, dst, blocks=self.staging if dst.kind is PoolKind.BLOCKS else None)

    def convert(self) -> None:
        """Repack the staged blocks into ours (nothing to do without staging)."""
        if self.staging is not None:
            kernels.repack_blocks(self.staging, self.peer_layout, self.ids, self.pool.blocks, self.pool.layout,
                                  self.block_ids)


class InboundPull:
    """One Pull RPC, used once: ``await run()`` returns the plan once the bytes are verified in
    place, or raises StatusError (INTERNAL for a stream or plan that disagrees with the grant,
    UNAVAILABLE for a lost peer or a failed UCX receive, DATA_LOSS for missing or corrupt bytes).
    Cancelling ``run`` (the caller's deadline) cancels the stream and retires the receives too."""

    def __init__(self, call, *, address: str, grant: PrefillGrant, landing: Landing, ring_id: int,
                 transport: Transport, tag_base: int, integrity: bool, ucx: UcxNode | None,
                 metrics: ConnectorMetrics) -> None:
        self.call, self.address, self.grant, self.landing, self.ring_id = call, address, grant, landing, ring_id
        self.transport, self.tag_base, self.integrity = transport, tag_base, integrity
        self.ucx, self.metrics = ucx, metrics
        self.receives: ReceiveBatch | None = None  # posted and not all landed

    @staticmethod
    def tag_base_for(transport: Transport) -> int:
        """A fresh random nonzero tag base for UCX (0 for the gRPC stream)."""
        return (secrets.randbits(64) | 1) if transport is Transport.UCX else 0

    async def run(self) -> TransferPlan:
        try:
            source = await self._open()
            plan, views = self._plan(source)
            done, landed = await self._land_chunks(views)
            await self._verify(plan, views, done, landed)
            self.landing.convert()
            return plan
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INTERNAL, f"bad plan from {self.address}: {exc}") from None
        except (StatusError, asyncio.CancelledError, asyncio.TimeoutError):
            raise
        except Exception as exc:  # a transport failure (a UCX receive above all): the peer is gone or unreachable
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"{self.transport.label} transfer from {self.address} "
                              f"failed: {type(exc).__name__}: {exc}") from None
        finally:
            self.call.cancel()  # a prefill node still sending drops its endpoint, which cancels its sends
            await self._retire_receives()

    async def _read(self):
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            raise rpc_failure(exc, f"Pull from {self.address}") from None
        return None if msg is grpc.aio.EOF else msg

    async def _open(self) -> pb.PullGrant:
        """The stream's first message: the source side of the plan, checked against the grant."""
        first = await self._read()
        if first is None or first.WhichOneof("message") != "grant":
            raise StatusError(grpc.StatusCode.INTERNAL, "Pull stream did not start with a grant")
        source = first.grant
        if ring_from(source.ring_live) != self.grant.ring_live or len(source.src_block_ids) != len(self.landing.ids):
            raise StatusError(grpc.StatusCode.INTERNAL, "Pull grant disagrees with the Prefill response")
        return source

    def _plan(self, source: pb.PullGrant) -> tuple[TransferPlan, list[torch.Tensor]]:
        """Our own plan (ValueError for ids outside our pools), checked against the grant's
        totals; the views it lands in, with the UCX receives posted on them."""
        pool = self.landing.pool
        plan = plan_transfer(pool.layout, list(source.src_block_ids), list(self.landing.ids), source.src_ring_id,
                             self.ring_id, self.grant.ring_live, dst_num_blocks=self.landing.num_blocks,
                             dst_num_rings=pool.num_rings)
        if len(plan) != source.num_regions or plan.total_bytes != source.total_bytes or len(plan) > MAX_REGIONS:
            raise StatusError(grpc.StatusCode.INTERNAL, f"plan of {len(plan)} regions / {plan.total_bytes} B disagrees "
                              f"with the grant's {source.num_regions} / {source.total_bytes}")
        views = [self.landing.view(pair) for pair in plan.pairs]
        if self.transport is Transport.UCX:
            self.receives = self.ucx.post_receives(views, self.tag_base)
        return plan, views

    async def _land_chunks(self, views: list[torch.Tensor]) -> tuple[pb.PullDone, list[int]]:
        """Write each chunk where it belongs until PullDone; the bytes landed per region."""
        landed = [0] * len(views)
        while True:
            msg = await self._read()
            if msg is None:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, "Pull stream ended without PullDone")
            kind = msg.WhichOneof("message")
            if kind == "done":
                return msg.done, landed
            if kind != "chunk":
                raise StatusError(grpc.StatusCode.INTERNAL, f"unexpected {kind} message in a Pull stream")
            ch = msg.chunk
            if self.transport is not Transport.GRPC_STREAM or ch.region >= len(views) or ch.offset != landed[ch.region] \
                    or ch.offset + len(ch.data) > views[ch.region].numel():
                raise StatusError(grpc.StatusCode.INTERNAL, f"unexpected chunk (region {ch.region}, offset {ch.offset})")
            regions.write_bytes(views[ch.region][ch.offset:ch.offset + len(ch.data)], ch.data)
            landed[ch.region] += len(ch.data)

    async def _verify(self, plan: TransferPlan, views: list[torch.Tensor], done: pb.PullDone, landed: list[int]) -> None:
        """Every byte is in place (UCX: every receive completed) and, with ``integrity``, every
        region's crc32 matches the sender's."""
        if self.receives is not None:
            await self.receives.wait()
            self.receives = None
        elif landed != [v.numel() for v in views]:
            raise StatusError(grpc.StatusCode.DATA_LOSS, f"stream ended with {sum(landed)} of {plan.total_bytes} bytes")
        if self.integrity:
            got = [regions.crc32(v) for v in views]
            bad = [i for i, (a, b) in enumerate(zip(got, done.crc32)) if a != b]
            if len(done.crc32) != len(views) or bad:
                raise StatusError(grpc.StatusCode.DATA_LOSS,
                                  f"crc32 mismatch in regions {bad or 'all (none sent)'} of {self.grant.request_id}")

    async def _retire_receives(self) -> None:
        """Receives posted into our memory by a pull that failed: retire them before the caller
        frees the blocks (no-op once every receive landed)."""
        if self.receives is None:
            return
        receives, self.receives = self.receives, None
        stuck = await self.ucx.abandon(receives)
        if stuck:
            self.metrics.failures.labels("ucx_receive_abandoned").inc(stuck)
            logger.warning("pull of %s from %s: %d receives still pending after the sender went away",
                           self.grant.request_id, self.address, stuck)
