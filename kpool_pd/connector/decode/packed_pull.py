"""PackedPull on the decode node: the pulls of one step from one prefill node as one batch, their bytes in one
UCX message (``kpool_pd.connector.prefill.packed_pulls`` is the prefill node's side).

``pull_packed(peer, targets)`` plans each pull as ``PrefillPeer.pull`` does (the whole request, into the
first blocks of the caller's allocation, skipping its held blocks), posts one receive of every pull's regions
back to back into a buffer of its own (in pieces of ``PIECE_BYTES``, each under UCX's eager limit), sends
every pull in one PackedPull call, and copies each region into its blocks (in host memory as soon as the pieces
holding it landed, while later pieces travel; on a GPU once the message landed). The buffer comes from
``staging`` (kept between batches: a fresh one costs its first touch). It returns one outcome a target, in order:
what landed (``PackedLanded``), or the exception that failed that pull alone (a refused grant, a plan its
allocation cannot take, bytes that disagree with the plan); the others land. A failure of the call or of the
message fails every pull of the batch. The receive lands in the batch's own buffer, never in the caller's blocks,
and whatever happens, nothing is written into an allocation once ``pull_packed`` returned or raised; before that,
a pull that fails may have had some of its blocks written (in host memory: the pieces landed before the answer
named it refused), as a failed pull of its own may: its caller recomputes them. A node that does not serve
PackedPull raises ``PackedPullUnsupported`` before anything landed (the caller pulls each alone).

Eligible peers (``can_pack``): UCX on both sides and the node's layout ours (a peer whose layout is arranged
otherwise needs staging and a repack a pull: it pulls each alone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.decode.grant import PrefillGrant
from kpool_pd.connector.decode.inbound import InboundPull
from kpool_pd.connector.decode.peer import PrefillPeer
from kpool_pd.connector.decode.share import WHOLE_REQUEST, PullTarget
from kpool_pd.connector.shared import hops, regions
from kpool_pd.connector.shared.errors import StatusError, rpc_failure, status_code
from kpool_pd.connector.shared.packed_staging import PIECE_BYTES, StagingBuffers, copy_all, piece_views, pieces
from kpool_pd.connector.shared.ucx import ReceiveBatch, UcxNode
from kpool_pd.connector.shared.plan import TransferPlan
from kpool_pd.connector.shared.wire import Transport, region_message
from kpool_pd.kvcache import CacheAllocation

logger = logging.getLogger(__name__)


class PackedPullUnsupported(Exception):
    """The prefill node does not serve PackedPull (nothing landed): pull each alone."""


@dataclass(frozen=True)
class PackedTarget:
    """One pull of a batch: ``grant`` into the first blocks of ``into`` (held by the caller), the block-table
    indices ``held`` (increasing) not pulled (this node holds them: a prefix-cache hit)."""

    grant: PrefillGrant
    into: CacheAllocation
    held: tuple[int, ...] = ()


@dataclass(frozen=True)
class PackedLanded:
    """A pull of a batch that landed: its bytes and regions, and the batch's seconds from the call to the unpack."""

    nbytes: int
    regions: int
    seconds: float


@dataclass(frozen=True)
class _Planned:
    index: int
    plan: TransferPlan
    views: tuple[torch.Tensor, ...]  # where each region lands (uint8, our blocks)
    offset: int  # of its first region in the message


def can_pack(peer: PrefillPeer) -> bool:
    """Whether ``peer``'s pulls may go in a PackedPull: UCX on both nodes, its layout ours, the peer open."""
    return (not peer.closed and not peer.repacks and Transport.UCX in peer.transports
            and peer.context.ucx is not None)


def plan_target(peer: PrefillPeer, target: PackedTarget) -> TransferPlan:
    """The plan of one target (as ``PrefillPeer.pull`` plans the whole request); ValueError for an allocation
    that cannot take it."""
    pool, grant, into = peer.context.pool, target.grant, target.into
    ours = pool.layout
    WHOLE_REQUEST.check(grant, ours=ours, peer_layout=peer.layout, held=target.held, address=peer.address)
    landed = WHOLE_REQUEST.blocks_landed(ours, grant)
    ringless = into.ring_id is None and ours.ring_slots > 0
    if into.released or ringless or into.pool is not pool or into.num_blocks < landed:
        raise ValueError(f"pull of {grant.request_id} needs a held allocation of this node's cache with a ring "
                         f"and at least {landed} blocks, got {into!r}")
    target_ids = PullTarget(layout=ours, peer_layout=peer.layout, block_ids=into.block_ids[:landed],
                            ring_id=0 if into.ring_id is None else into.ring_id, num_blocks=pool.num_blocks,
                            num_rings=pool.num_rings)
    return WHOLE_REQUEST.plan(grant, target_ids, target.held)


def settle_views(views: Sequence[torch.Tensor]) -> None:
    """Wait for the copies queued into ``views`` on their GPUs' current streams (nothing for host memory)."""
    for device in {v.device for v in views if v.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


async def retire_receive(ucx: UcxNode, receive: ReceiveBatch, staging: StagingBuffers, buffer: torch.Tensor) -> None:
    """Retire a failed batch's receives; their buffer is kept for a later batch once none is pending."""
    if await ucx.abandon(receive) == 0:
        staging.give(buffer)


async def _land_as_pieces_come(message: torch.Tensor, receive: ReceiveBatch, planned: list[_Planned]) -> None:
    """Copy each planned region's bytes from ``message`` (uint8, in host memory) into its view as soon as the pieces
    holding them landed, piece by piece in order, so that the copies run while later pieces travel; stops at a
    failed piece (the batch then fails) or when cancelled."""
    spans = [(at, view) for pull in planned for at, view in _region_offsets(pull)]
    for landed, (_, places, sources) in zip(receive.futures, piece_views(spans, message, PIECE_BYTES)):
        try:
            await asyncio.shield(landed)
        except Exception:  # the receive failed: the batch's wait raises it
            return
        copy_all(places, sources)


def _region_offsets(pull: _Planned) -> list[tuple[int, torch.Tensor]]:
    """(offset in the message, view) of each of ``pull``'s regions."""
    offsets, at = [], pull.offset
    for view in pull.views:
        offsets.append((at, view))
        at += view.numel()
    return offsets


async def pull_packed(peer: PrefillPeer, targets: Sequence[PackedTarget], *, staging: StagingBuffers,
                      integrity: bool = False) -> list[PackedLanded | BaseException]:
    """Pull ``targets`` from ``peer`` in one PackedPull (see the module), through a buffer of ``staging`` (on the
    pool's device): one outcome a target, in order.
    PackedPullUnsupported when the node does not serve it; every outcome is then unset (nothing landed).
    Within ``pull_budget_s``: DEADLINE_EXCEEDED for every pull of a batch whose message did not land."""
    context = peer.context
    pool, ucx, started = context.pool, context.ucx, time.perf_counter()
    outcomes: list = [None] * len(targets)
    planned: list[_Planned] = []
    requests: list[pb.PullRequest] = []
    tag, offset = InboundPull.tag_base_for(Transport.UCX), 0
    for index, target in enumerate(targets):
        try:
            plan = plan_target(peer, target)
            views = tuple(regions.region_view(pool, pair.dst) for pair in plan.pairs)
        except (ValueError, StatusError) as exc:
            outcomes[index] = exc
            continue
        planned.append(_Planned(index, plan, views, offset))
        offset += plan.total_bytes
        requests.append(packed_request(peer, target.grant.grant_id, plan, tag, integrity))
    if not planned:
        return outcomes
    buffer = staging.take(offset)
    message = buffer[:offset]
    receive = ucx.post_receives([message[at:at + length] for at, length in pieces(offset, PIECE_BYTES)], tag)
    budget = context.config.pull_budget_s(computing=False)
    deadline = time.monotonic() + budget
    landed = False
    early = message.device.type == "cpu"  # host memory: each piece is copied into the blocks as it lands
    landing = asyncio.ensure_future(_land_as_pieces_come(message, receive, planned)) if early else None
    try:
        for request in requests:
            hops.stamp(request.grant_id, "written")
        answers = await packed_call(peer, requests, tag, budget)
        served = []
        for pull, answer in zip(planned, answers):
            if isinstance(answer, StatusError):
                outcomes[pull.index] = answer
            else:
                served.append((pull, answer))
        if served:
            await message_landed(peer, receive, deadline, budget)
            if landing is not None:
                await landing
            landed = True
            _unpack(message, served, outcomes, peer.address, integrity, copied=early)
            seconds = time.perf_counter() - started
            for pull, _ in served:
                if outcomes[pull.index] is None:
                    hops.stamp(targets[pull.index].grant.grant_id, "landed")
                    context.metrics.transferred(Transport.UCX.label, pull.plan.total_bytes, len(pull.plan), seconds)
                    outcomes[pull.index] = PackedLanded(pull.plan.total_bytes, len(pull.plan), seconds)
    except StatusError as exc:
        for pull in planned:
            if outcomes[pull.index] is None:
                outcomes[pull.index] = exc
    finally:
        if landing is not None:
            landing.cancel()  # no copy into the blocks once this returns
        if landed:
            staging.give(buffer)
        else:  # retire the receives (they land in ``buffer`` only, never in the caller's blocks)
            retire = asyncio.ensure_future(retire_receive(ucx, receive, staging, buffer))
            retire.add_done_callback(lambda task: task.cancelled() or task.exception())
    return outcomes


def packed_request(peer: PrefillPeer, grant_id: str, plan: TransferPlan, tag: int, integrity: bool) -> pb.PullRequest:
    """One pull of a PackedPull batch of this engine's (UCX tag ``tag``): ``plan``'s source regions of ``grant_id``."""
    context = peer.context
    return pb.PullRequest(grant_id=grant_id, engine_id=context.engine_id, engine_secret=context.secrets.get(peer.address),
                          transport=Transport.UCX.value, integrity=integrity, ucx_tag_base=tag,
                          regions=[region_message(pair.src) for pair in plan.pairs])


async def packed_call(peer: PrefillPeer, requests: list[pb.PullRequest], tag: int,
                      budget: float) -> list[pb.PullDone | StatusError]:
    """The PackedPull call of ``requests`` (UCX tag ``tag``): one outcome a request, in order: its PullDone, or
    the StatusError that refused it alone. PackedPullUnsupported for a node that does not serve the call;
    StatusError for a call that failed whole."""
    try:
        answer = await peer._stub.PackedPull(pb.PackedPullRequest(pulls=requests, ucx_tag=tag, piece_bytes=PIECE_BYTES),
                                   timeout=budget)
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
            raise PackedPullUnsupported(f"{peer.address} does not serve PackedPull") from None
        raise rpc_failure(exc, f"PackedPull of {len(requests)} pulls from {peer.address}") from None
    if len(answer.results) != len(requests):
        raise StatusError(grpc.StatusCode.INTERNAL, f"PackedPull from {peer.address} answered "
                          f"{len(answer.results)} results for {len(requests)} pulls")
    outcomes: list[pb.PullDone | StatusError] = []
    for request, result in zip(requests, answer.results):
        if result.grant_id != request.grant_id:
            outcomes.append(StatusError(grpc.StatusCode.INTERNAL, f"PackedPull from {peer.address} answered grant "
                                        f"{result.grant_id!r} out of order"))
        elif result.WhichOneof("message") == "failure":
            outcomes.append(StatusError(status_code(result.failure.code),
                                        f"Pull from {peer.address}: {result.failure.message}"))
        else:
            outcomes.append(result.response.done)
    return outcomes


async def message_landed(peer: PrefillPeer, receive: ReceiveBatch, deadline: float, budget: float) -> None:
    """Wait for a PackedPull's message (``receive``) until ``deadline`` (monotonic); StatusError DEADLINE_EXCEEDED
    past it, UNAVAILABLE for a receive UCX failed."""
    try:
        await asyncio.wait_for(receive.wait(), max(deadline - time.monotonic(), 0))
    except asyncio.TimeoutError:
        raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"PackedPull from {peer.address}: its message "
                          f"did not land within {budget} s") from None
    except Exception as exc:  # the receive failed in UCX
        raise StatusError(grpc.StatusCode.UNAVAILABLE, f"PackedPull from {peer.address}: {exc}") from None


def _unpack(message: torch.Tensor, served: list, outcomes: list, address: str, integrity: bool, *,
            copied: bool = False) -> None:
    """Copy each served pull's span of ``message`` into its regions (unless ``copied`` as the pieces landed); a
    pull whose PullDone disagrees with its plan, or whose bytes fail their crc32 (``integrity``), fails alone
    (DATA_LOSS)."""
    dst, src = [], []
    for pull, done in served:
        plan = pull.plan
        if done.bytes != plan.total_bytes or done.regions != len(plan):
            outcomes[pull.index] = StatusError(grpc.StatusCode.DATA_LOSS, f"Pull from {address}: PullDone states "
                                               f"{done.bytes} bytes in {done.regions} regions, the plan "
                                               f"{plan.total_bytes} in {len(plan)}")
            continue
        at = pull.offset
        for view in pull.views:
            dst.append(view)
            src.append(message[at:at + view.numel()])
            at += view.numel()
    if not copied:
        copy_all(dst, src)
    settle_views([view for pull, _ in served for view in pull.views])
    if integrity:
        for pull, done in served:
            if outcomes[pull.index] is None and list(done.crc32) != [regions.crc32(v) for v in pull.views]:
                outcomes[pull.index] = StatusError(grpc.StatusCode.DATA_LOSS, f"Pull from {address}: a region's "
                                                   "crc32 differs from the prefill node's")
