"""The decode side of one Pull stream: from the PullRequest to the prompt's bytes verified in our blocks.

The steps, in order (``InboundPull.run``): take the plan the peer made once from the Prefill response
(which names the source blocks and ring; ``kpool_pd.connector.decode.share``), open the stream with the plan in
its request and post the UCX receives on it (the prefill node checks the plan against the grant, and starts
its UCX sends as the Pull arrives); land the stream's chunks (gRPC stream) until PullDone;
verify that every byte arrived (and its crc32 when asked); convert from the peer's layout. Whatever step fails, the stream is cancelled and the
receives posted into our memory are retired before ``run`` returns, so that the caller may free
the blocks at once.

A prefill node whose layout arranges the same cache otherwise (its block size, order or kernel
page differ from ours) sends its blocks as they are: they land in a staging buffer kept for that peer
(``kpool_pd.connector.decode.staging``) in the peer's layout, as a same-layout pull lands in our blocks, and
``kernels.repack_tokens`` places the prompt's positions into our blocks (the ring's layout does not depend on
those fields: it lands directly), enqueued on the device behind the landing: the pull's ``ready`` says when its
writes are complete, and the host does not wait for them. With equal layouts the bytes land in our blocks with
no staging copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

import grpc
import torch

from kpool_pd import kernels
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.decode.grant import PrefillGrant, PullTimeline, TransferTimes, grant_from
from kpool_pd.connector.decode.staging import BlocksReady, RepackStaging
from kpool_pd.connector.shared import hops, regions
from kpool_pd.connector.shared.errors import StatusError, rpc_failure
from kpool_pd.connector.shared.metrics import ConnectorMetrics
from kpool_pd.connector.shared.plan import PoolKind, RegionPair, TransferPlan
from kpool_pd.connector.shared.pull_frames import ChunkFrame
from kpool_pd.connector.shared.ucx import MAX_REGIONS, ReceiveBatch, UcxNode
from kpool_pd.connector.shared.wire import Transport
from kpool_pd.kvcache import BlockLayout, CachePool

logger = logging.getLogger(__name__)

# A Pull call's loop steps after its request is handed on before the landing's repack table is made, so that the
# request leaves first (made at once, it delayed a session's request by up to 0.3 ms on an H100 host; a session's
# pull makes it once its request was written).
PREPARE_AFTER_STEPS = 3


class Landing:
    """Where a pull's blocks land. Equal layouts: straight into ``block_ids`` of our pool. A peer
    layout that arranges the same cache otherwise (block size, order, kernel page; see
    ``kpool_pd.connector.shared.compat``): the peer's blocks land as they are in staging blocks 0..n-1 (n =
    ``source_blocks``, each of the peer's block bytes), lent by ``buffers`` (the peer's ``RepackStaging``; a
    buffer of its own without), which ``convert`` places into ``block_ids`` (ours: the prompt's blocks in our
    block size) with ``kernels.repack_tokens``, enqueued on the device behind the landing; ``release`` gives the
    buffer back. ``ids`` are what the PullRequest names."""

    __slots__ = ("pool", "peer_layout", "block_ids", "staging", "ids", "num_tokens", "_staged", "_buffers", "_ours")

    def __init__(self, pool: CachePool, peer_layout: BlockLayout, block_ids: tuple[int, ...], *,
                 source_blocks: int, num_tokens: int, buffers: RepackStaging | None = None) -> None:
        self.pool, self.peer_layout, self.block_ids, self.num_tokens = pool, peer_layout, block_ids, num_tokens
        repacks = peer_layout.layout_hash != pool.layout.layout_hash
        self._buffers = (buffers or RepackStaging(peer_layout, pool.device, keep_idle=0)) if repacks else None
        # staging: [source_blocks, the peer's block_bytes] uint8 on the pool's device, or None
        self._staged = self._buffers.take(source_blocks) if repacks and source_blocks else None
        self.staging = self._staged.blocks if self._staged is not None else None
        self.ids = tuple(range(source_blocks)) if repacks else block_ids
        self._ours: torch.Tensor | None = None  # our block table on the device, for the repack (``prepare``)

    @property
    def num_blocks(self) -> int:
        """Blocks the landing ids may name (the staging buffer's, else the pool's)."""
        return len(self.ids) if self._buffers is not None else self.pool.num_blocks

    def view(self, pair: RegionPair) -> torch.Tensor:
        """uint8 [nbytes]: where the destination region of ``pair`` lands."""
        dst = pair.dst
        return regions.region_view(self.pool, dst, blocks=self.staging if dst.kind is PoolKind.BLOCKS else None)

    def prepare(self) -> None:
        """Put our block table on the device, so that ``convert`` only launches the repack: from pinned memory
        without waiting (``kernels.block_ids_on``); the staged table is the buffer's own. The pull calls it once its
        request is under way, while the bytes travel. Nothing to do without staging, or once done."""
        if self.staging is not None and self._ours is None:
            self._ours = kernels.block_ids_on(self.block_ids, self.pool.device)

    def convert(self, passed: Callable[[str], None] = lambda hop: None) -> BlocksReady:
        """Place the staged prompt (positions [0, num_tokens)) into our blocks: on CUDA the repack is enqueued on
        the pool device's current stream, and the returned ``BlocksReady`` is its event (the host waits for
        nothing); on the CPU it runs here. ``BlocksReady.NOW`` without staging. ``passed(hop)`` is told when the
        block table is on the device ("prepared") and the repack enqueued ("repacked"), for the hop stamps."""
        if self.staging is None:
            return BlocksReady.NOW
        self.prepare()
        passed("prepared")
        kernels.repack_tokens(self.staging, self.peer_layout, self._staged.ids, self.pool.blocks, self.pool.layout,
                              self._ours, self.num_tokens)
        passed("repacked")
        return BlocksReady.behind_current_work(self.pool.device)

    def release(self, ready: BlocksReady | None) -> None:
        """Give the staging buffer back, free once ``ready`` is done (None: the pull failed with receives still
        pending into it, so it is not lent again). Idempotent; nothing to do without staging."""
        staged, self._staged, self.staging = self._staged, None, None
        if staged is not None and ready is not None:
            self._buffers.give_back(staged, ready)


class InboundPull:
    """One Pull RPC, used once: ``await run()`` returns the plan once the bytes are verified in
    place, or raises StatusError (INTERNAL for a stream or plan that disagrees with the grant,
    UNAVAILABLE for a lost peer or a failed UCX receive, DATA_LOSS for missing or corrupt bytes).
    Cancelling ``run`` (the caller's deadline) cancels the stream and retires the receives too."""

    def __init__(self, open_call: Callable[[], grpc.aio.UnaryStreamCall], *, address: str, grant: PrefillGrant,
                 landing: Landing, ring_id: int, transport: Transport, tag_base: int, integrity: bool, ucx: UcxNode | None,
                 metrics: ConnectorMetrics, keep: Callable[[asyncio.Task], None], plan: TransferPlan,
                 on_granted: Callable[[PrefillGrant], None] | None = None) -> None:
        self.open_call, self.address, self.grant, self.landing, self.ring_id = open_call, address, grant, landing, ring_id
        self.call: grpc.aio.UnaryStreamCall | None = None
        self.transport, self.tag_base, self.integrity = transport, tag_base, integrity
        self.ucx, self.metrics, self.keep = ucx, metrics, keep
        self.planned = plan  # the pull's one plan: where each region lands here
        self.receives: ReceiveBatch | None = None  # posted and not all landed
        self.views: list[torch.Tensor] = []  # where the regions land, once planned
        self.follower: asyncio.Task | None = None  # the stream, followed on after the bytes landed
        self.plan: TransferPlan | None = None  # set once ``run`` succeeded, with ``timeline``, ``times``, ``first_token``
        self.timeline: PullTimeline | None = None
        self.times: TransferTimes | None = None
        self.ready: BlocksReady | None = None  # once converted: when the repack's writes into our blocks are complete
        self.first_token: int = grant.first_token
        self.prefill_done: tuple[float, pb.PrefillDone] | None = None  # a pipelined grant's, with when it arrived
        self.last_landed = 0.0  # when the last byte landed (perf_counter)
        self.receives_landed = 0  # UCX receives completed so far
        self.done: pb.PullDone | None = None  # the stream's last message, once read
        # A push (PrefillPush): ``grant`` is the one planned from the prompt until the stream's first message states
        # the grant made; ``on_granted`` hears of it then, and ``granted_at`` is when it came (perf_counter).
        self.on_granted, self.granted_at = on_granted, 0.0
        # What the pull hands over besides the bytes is known (its first token, and what it states of its times):
        # at once for a Pull of a grant made after its prompt; for a pipelined grant once PrefillDone came stating
        # its times; else (a push granted after its prompt, a node whose PrefillDone states no times) with PullDone.
        # A UCX pull without integrity ends when its receives completed and this is set.
        self.known = asyncio.Event()
        if not grant.pipelined:
            self.known.set()

    @property
    def key(self) -> str:
        """What the hop stamps name this pull by: its grant, or a push's request until the grant is known."""
        return self.grant.grant_id or f"push-{self.grant.request_id}"

    @staticmethod
    def tag_base_for(transport: Transport) -> int:
        """A fresh random nonzero tag base for UCX (0 for the gRPC stream)."""
        return (secrets.randbits(64) | 1) if transport is Transport.UCX else 0

    async def run(self) -> TransferPlan:
        """The receives are posted before the request leaves a Pull call's own stream (its request is sent once
        ``run`` first waits), and on a pull session once gRPC has the request: posting them (0.1-0.3 ms) then
        overlaps the request's way to the prefill node, and a message that comes before its receive is kept by
        UCX until the receive is posted."""
        try:
            hops.stamp(self.key, "pull")
            marks = [time.perf_counter()]
            if (regions_planned := len(self.planned)) > MAX_REGIONS:  # before the request leaves: no send then
                raise StatusError(grpc.StatusCode.INTERNAL, f"plan of {regions_planned} regions (limit {MAX_REGIONS})")
            self.call = self.open_call()
            when_written = getattr(self.call, "when_written", None)  # a session's pull tells when its request left
            if when_written is not None:
                when_written(self._prepare_landing)
            else:
                self._prepare_behind_request(asyncio.get_running_loop(), PREPARE_AFTER_STEPS)
            handed = getattr(self.call, "handed", None)
            if handed is not None:  # a session's pull: its receives are posted while its request travels
                await handed
            plan, views = self._post()  # a call of its own sends its request once this returns
            hops.stamp(self.key, "posted")
            marks.append(time.perf_counter())
            if self.transport is Transport.UCX and not self.integrity:
                await self._land_on_receives()
                marks.append(time.perf_counter())
                marks.append(marks[-1])  # nothing to complete after the receives
            else:
                done, landed = await self._land_chunks(views)
                marks.append(time.perf_counter())
                await self._wait_landed(plan, views, landed)
                marks.append(time.perf_counter())
                self._verify(views, done)
            self.ready = self.landing.convert(lambda hop: hops.stamp(self.key, hop))
            marks.append(time.perf_counter())
            self.plan, self.timeline = plan, PullTimeline(*((b - a) * 1000 for a, b in zip(marks, marks[1:])))
            self.times = self._times(marks)
            hops.stamp(self.key, "returned")
            return plan
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.INTERNAL, f"bad plan from {self.address}: {exc}") from None
        except (StatusError, asyncio.CancelledError, asyncio.TimeoutError):
            raise
        except Exception as exc:  # a transport failure (a UCX receive above all): the peer is gone or unreachable
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"{self.transport.label} transfer from {self.address} "
                              f"failed: {type(exc).__name__}: {exc}") from None
        finally:
            if self.call is not None and self.follower is None:
                self.call.cancel()  # a prefill node still sending aborts this pull's endpoint, cancelling its sends
            stuck = 0
            try:
                stuck = await self._retire_receives()
                if self._wrote_on_stream():  # our writes into GPU memory have landed before the memory is used or freed
                    regions.settle(self.views)
            finally:  # the staging buffer goes back: free once the repack ran (a failed pull's: at once)
                self.landing.release(None if stuck else self.ready or BlocksReady.NOW)

    def _wrote_on_stream(self) -> bool:
        """Whether this pull wrote into memory through the current CUDA stream: the gRPC stream's chunks
        (``regions.write_bytes``). UCX lands the bytes itself, complete once each receive completed, so a UCX pull
        waits for no stream: in a decode daemon that stream also runs the decode steps, and waiting for it held the
        event loop up to a step. A repack from staging is enqueued on that stream behind the landing, and the
        blocks' readiness is its event (``ready``), which the blocks' next reader waits on, not the host."""
        return self.transport is Transport.GRPC_STREAM

    def _prepare_behind_request(self, loop: asyncio.AbstractEventLoop, steps: int) -> None:
        """``_prepare_landing`` ``steps`` loop steps from now, behind the steps that hand a Pull call's request on
        to gRPC (a session's pull prepares once its request was written)."""
        if steps > 0:
            loop.call_soon(self._prepare_behind_request, loop, steps - 1)
        else:
            self._prepare_landing()

    def _prepare_landing(self) -> None:
        """``Landing.prepare`` once the request is on its way, while the bytes travel. Should it fail, ``convert``
        prepares again and raises there, in the pull; once the pull ended it finds nothing to do."""
        with contextlib.suppress(Exception):
            self.landing.prepare()

    def _times(self, marks: list[float]) -> TransferTimes:
        """The request's TransferTimes (see there); ``marks``: ``run``'s time marks. A pipelined grant's exposure
        ends at the last byte landed here: what PrefillDone states of the sends after the prompt's end, and the
        bytes that landed here after it came; PullDone, which may come after the pull ended, gives the send time
        where it came, and the times of a prefill node that does not state them."""
        done = self.done
        if not self.grant.pipelined and self.granted_at:  # a push granted once its prompt was computed
            here = (max(self.last_landed, self.granted_at) - self.granted_at) * 1000
            return TransferTimes(prefill_ms=self.grant.prefill_ms, transfer_ms=done.send_ms if done else here,
                                 exposed_transfer_ms=max(here, done.sent_after_prefill_ms if done else 0.0))
        if not self.grant.pipelined:
            whole = (marks[-2] - marks[1]) * 1000  # Pull to the bytes verified
            return TransferTimes(prefill_ms=self.grant.prefill_ms, transfer_ms=whole, exposed_transfer_ms=whole)
        arrived, prefilled = self.prefill_done
        if prefilled.HasField("after_prompt_ms"):
            here = max(0.0, self.last_landed - arrived) * 1000  # bytes still landing after PrefillDone came
            return TransferTimes(prefill_ms=prefilled.prefill_ms, exposed_transfer_ms=prefilled.after_prompt_ms + here,
                                 transfer_ms=done.send_ms if done else prefilled.sent_ms + here)
        here = (max(self.last_landed, arrived) - arrived) * 1000  # its arrival to the last byte landed
        return TransferTimes(prefill_ms=prefilled.prefill_ms, transfer_ms=done.send_ms if done else here,
                             exposed_transfer_ms=max(here, done.sent_after_prefill_ms if done else 0.0))

    def _landed(self, _future: asyncio.Future) -> None:
        self.last_landed = max(self.last_landed, time.perf_counter())
        self.receives_landed += 1
        if self.receives_landed == len(self.planned):  # the last receive: where a push's exposed time ends
            hops.stamp(self.key, "received")

    async def _land_on_receives(self) -> None:
        """UCX without integrity: the bytes are in place once every receive completed, and the pull ends when
        they did and what it hands over is known (``known``: a pipelined grant's PrefillDone stating its times);
        PullDone is then not waited for: it states nothing this node checks. A stream that fails first fails the pull; once
        the pull ended, the stream is followed to its end in the background (``keep``), not cancelled:
        cancelling it would cancel sends whose completion the prefill node may not have seen yet."""
        follow = asyncio.ensure_future(self._land_chunks(self.views))
        landed = asyncio.ensure_future(self.receives.wait())  # cancelling it leaves the receives posted
        known = asyncio.ensure_future(self.known.wait())
        try:
            while not (landed.done() and known.done()):
                await asyncio.wait({task for task in (follow, landed, known) if not task.done()},
                                   return_when=asyncio.FIRST_COMPLETED)
                for task in (follow, landed):  # a failure raises here; PullDone read set ``known``
                    if task.done():
                        task.result()
                if landed.done():
                    hops.stamp(self.grant.grant_id, "landed")
        except BaseException:
            for task in (follow, landed, known):
                task.cancel()
            await asyncio.gather(follow, landed, known, return_exceptions=True)
            raise
        self.receives = None
        if not follow.done():
            self.follower = follow
            self.keep(follow)

    async def _read(self):
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            raise rpc_failure(exc, f"Pull from {self.address}") from None
        return None if msg is grpc.aio.EOF else msg

    def _post(self) -> tuple[TransferPlan, list[torch.Tensor]]:
        """The views the plan lands in, with the UCX receives posted on them (``run`` says when)."""
        plan = self.planned
        views = self.views = [self.landing.view(pair) for pair in plan.pairs]
        if self.transport is Transport.UCX:
            self.receives = self.ucx.post_receives(views, self.tag_base)
            for future in self.receives.futures:
                future.add_done_callback(self._landed)
        return plan, views

    async def _land_chunks(self, views: list[torch.Tensor]) -> tuple[pb.PullDone, list[int]]:
        """Write each chunk where it belongs until PullDone; the bytes landed per region. A pipelined
        grant's stream also brings PrefillDone (once, before PullDone): the first token."""
        landed = [0] * len(views)
        while True:
            msg = await self._read()
            if msg is None:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, "Pull stream ended without PullDone")
            kind = "chunk" if isinstance(msg, ChunkFrame) else msg.WhichOneof("message")
            if kind == "granted" and self.on_granted is not None and not self.granted_at:
                self._granted(msg.granted)
                continue
            if kind == "prefilled" and self.grant.pipelined and self.prefill_done is None:
                self.prefill_done = (time.perf_counter(), msg.prefilled)
                hops.stamp(self.key, "prefilled")
                self.first_token = msg.prefilled.first_token
                if msg.prefilled.HasField("after_prompt_ms"):
                    self.known.set()
                continue
            if kind == "done":
                if self.grant.pipelined and self.prefill_done is None:
                    raise StatusError(grpc.StatusCode.INTERNAL, "Pull stream of a pipelined grant ended without "
                                      "PrefillDone")
                self.done = msg.done
                self.known.set()
                return msg.done, landed
            if kind != "chunk":
                raise StatusError(grpc.StatusCode.INTERNAL, f"unexpected {kind} message in a Pull stream")
            region, offset, data = msg.region, msg.offset, msg.data
            if self.transport is not Transport.GRPC_STREAM or region >= len(views) or offset != landed[region] \
                    or offset + len(data) > views[region].numel():
                raise StatusError(grpc.StatusCode.INTERNAL, f"unexpected chunk (region {region}, offset {offset})")
            regions.write_bytes(views[region][offset:offset + len(data)], data)
            landed[region] += len(data)
            self.last_landed = time.perf_counter()

    def _granted(self, response: pb.PrefillResponse) -> None:
        """A push's grant arrived: it must be the one planned from the prompt (INTERNAL otherwise)."""
        self.granted_at = time.perf_counter()
        grant, planned = grant_from(response), self.grant
        if grant.grant_id:
            self.on_granted(grant)  # the caller's to release, whatever follows
        if (grant.request_id, grant.prompt_len, grant.num_blocks, grant.ring_live) != \
                (planned.request_id, planned.prompt_len, planned.num_blocks, planned.ring_live) or not grant.grant_id:
            raise StatusError(grpc.StatusCode.INTERNAL, f"push of {planned.request_id} to {self.address} was granted "
                              f"{grant.num_blocks} blocks for {grant.prompt_len} tokens (request {grant.request_id!r}), "
                              f"where {planned.num_blocks} blocks for {planned.prompt_len} tokens were planned")
        self.grant, self.first_token = grant, grant.first_token

    async def _wait_landed(self, plan: TransferPlan, views: list[torch.Tensor], landed: list[int]) -> None:
        """Every byte is in place: UCX, every receive completed; the gRPC stream, every chunk came."""
        if self.receives is not None:
            await self.receives.wait()
            self.receives = None
        elif landed != [v.numel() for v in views]:
            raise StatusError(grpc.StatusCode.DATA_LOSS, f"stream ended with {sum(landed)} of {plan.total_bytes} bytes")

    def _verify(self, views: list[torch.Tensor], done: pb.PullDone) -> None:
        """With ``integrity``, every region's crc32 matches the sender's."""
        if self.integrity:
            got = [regions.crc32(v) for v in views]
            bad = [i for i, (a, b) in enumerate(zip(got, done.crc32)) if a != b]
            if len(done.crc32) != len(views) or bad:
                raise StatusError(grpc.StatusCode.DATA_LOSS,
                                  f"crc32 mismatch in regions {bad or 'all (none sent)'} of {self.grant.request_id}")

    async def _retire_receives(self) -> int:
        """Receives posted into our memory by a pull that failed: retire them before the caller
        frees the blocks (no-op once every receive landed); how many are still pending (a dead sender's)."""
        if self.receives is None:
            return 0
        receives, self.receives = self.receives, None
        stuck = await self.ucx.abandon(receives)
        if stuck:
            self.metrics.failures.labels("ucx_receive_abandoned").inc(stuck)
            logger.warning("pull of %s from %s: %d receives still pending after the sender went away",
                           self.grant.request_id, self.address, stuck)
        return stuck
