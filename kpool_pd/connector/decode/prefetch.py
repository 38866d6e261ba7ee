"""Prefetch on the decode node: grants a prefill node announced to this engine (``AwaitOffers``) pulled before
their decode requests arrive, and landed into a request's blocks when its load comes.

``prefetch_packed(peer, grants, staging)`` pulls whole grants in one PackedPull (a pull like any other: a prefill
node that frees a grant once a pull sent it all frees these too) into one buffer of their own, laid out by the
grants' source regions. ``Prefetched.land(peer,
target)`` plans the load as a pull of it would (``kpool_pd.connector.decode.packed_pull``), finds each region the
plan reads inside the prefetched ones (a load's plan splits source runs where its own blocks are not consecutive,
and skips held blocks), and copies the bytes into the target's blocks. The bytes are the prefill node's, checked
as a pull's are (the PullDone's counts, its crc32s with ``integrity``), and never written into any block before a
load of this engine claims them under the same key (the grant id bound to the prompt's digest).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.decode.grant import PrefillGrant
from kpool_pd.connector.decode.inbound import InboundPull
from kpool_pd.connector.decode.packed_pull import (PackedTarget, message_landed, packed_call, packed_request,
                                                   plan_target, retire_receive, settle_views)
from kpool_pd.connector.decode.peer import PrefillPeer
from kpool_pd.connector.decode.share import WHOLE_REQUEST, PullTarget
from kpool_pd.connector.shared import regions
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.packed_staging import PIECE_BYTES, StagingBuffers, copy_all, pieces
from kpool_pd.connector.shared.plan import Region, TransferPlan
from kpool_pd.connector.shared.wire import Transport


class PrefetchBuffer:
    """One prefetch batch's buffer, shared by its grants: back to ``staging`` once each was landed or dropped."""

    def __init__(self, staging: StagingBuffers, buffer: torch.Tensor, holders: int) -> None:
        self.staging, self.buffer, self.holders = staging, buffer, holders

    def drop_one(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.staging.give(self.buffer)


@dataclass
class Prefetched:
    """A grant's bytes held here: each source region (by pool kind and plane, increasing offsets) and its
    offset in ``data`` (uint8 [nbytes], a view of the batch's buffer)."""

    grant_id: str
    nbytes: int
    regions: int
    seconds: float  # the prefetch's, from the call to the message's end
    landed_at: float  # monotonic
    data: torch.Tensor
    owner: PrefetchBuffer
    _spans: dict[tuple[object, int], list[tuple[int, int, int]]] = field(default_factory=dict)  # (kind, plane) ->
    # [(region offset, region bytes, offset in data)], by region offset
    dropped: bool = False

    def add(self, region: Region, at: int) -> None:
        spans = self._spans.setdefault((region.kind, region.plane), [])
        bisect.insort(spans, (region.offset, region.nbytes, at))

    def find(self, region: Region) -> int:
        """The offset in ``data`` of ``region``'s bytes; ValueError when no prefetched region holds it whole."""
        spans = self._spans.get((region.kind, region.plane), [])
        index = bisect.bisect_right(spans, (region.offset, float("inf"), 0)) - 1
        if index >= 0:
            start, nbytes, at = spans[index]
            if start + nbytes >= region.offset + region.nbytes:
                return at + region.offset - start
        raise ValueError(f"grant {self.grant_id!r}: region {region} was not prefetched")

    def land(self, peer: PrefillPeer, target: PackedTarget) -> TransferPlan:
        """Copy what ``target``'s plan reads (``plan_target``: held blocks skipped) into its blocks, and drop
        this entry's hold of its buffer; ValueError (nothing copied) for a plan it cannot serve."""
        if self.dropped:
            raise ValueError(f"grant {self.grant_id!r}'s prefetched bytes were dropped")
        if target.grant.grant_id != self.grant_id:
            raise ValueError(f"grant {target.grant.grant_id!r} is not the prefetched {self.grant_id!r}")
        plan = plan_target(peer, target)
        pool = peer.context.pool
        sources = [(self.find(pair.src), pair) for pair in plan.pairs]
        dst = [regions.region_view(pool, pair.dst) for _, pair in sources]
        src = [self.data[at:at + pair.src.nbytes] for at, pair in sources]
        copy_all(dst, src)
        settle_views(dst)
        self.drop()
        return plan

    def drop(self) -> None:
        if not self.dropped:
            self.dropped = True
            self.owner.drop_one()


def whole_plan(peer: PrefillPeer, grant: PrefillGrant) -> TransferPlan:
    """The plan of ``grant``'s every source region, each run of consecutive source blocks one region (its
    destination side names the same ids and is not used)."""
    ids = tuple(grant.src_block_ids)
    bound = max(ids, default=0) + 1
    target = PullTarget(layout=peer.context.pool.layout, peer_layout=peer.layout, block_ids=ids, ring_id=0,
                        num_blocks=bound, num_rings=1)
    return WHOLE_REQUEST.plan(grant, target, ())


async def prefetch_packed(peer: PrefillPeer, grants: Sequence[tuple[PrefillGrant, TransferPlan]], *,
                          staging: StagingBuffers, integrity: bool = False) -> list[Prefetched | BaseException]:
    """Pull ``grants`` (each whole, with its ``whole_plan``) from ``peer`` in one PackedPull, into one buffer of
    ``staging``: one outcome a grant, in order (what is held here, or why that grant was not). PackedPullUnsupported
    when the node does not serve the call (nothing held); a failed call or message fails every grant."""
    context = peer.context
    started = time.perf_counter()
    outcomes: list = [None] * len(grants)
    planned: list[tuple[int, TransferPlan, int]] = []  # (index, plan, offset in the message)
    requests: list[pb.PullRequest] = []
    tag, offset = InboundPull.tag_base_for(Transport.UCX), 0
    for index, (grant, plan) in enumerate(grants):
        planned.append((index, plan, offset))
        offset += plan.total_bytes
        requests.append(packed_request(peer, grant.grant_id, plan, tag, integrity))
    if not planned:
        return outcomes
    buffer = staging.take(offset)
    message = buffer[:offset]
    receive = context.ucx.post_receives([message[at:at + length] for at, length in pieces(offset, PIECE_BYTES)], tag)
    budget = context.config.pull_budget_s(computing=False)
    deadline = time.monotonic() + budget
    landed = False
    try:
        answers = await packed_call(peer, requests, tag, budget)
        served = [(entry, done) for entry, done in zip(planned, answers) if not isinstance(done, StatusError)]
        for (index, _, _), done in zip(planned, answers):
            if isinstance(done, StatusError):
                outcomes[index] = done
        if served:
            await message_landed(peer, receive, deadline, budget)
        landed = True
    except StatusError as exc:
        for index, _, _ in planned:
            if outcomes[index] is None:
                outcomes[index] = exc
    finally:
        if not landed:  # the receives land in ``buffer`` only: retired before it is reused
            retire = asyncio.ensure_future(retire_receive(context.ucx, receive, staging, buffer))
            retire.add_done_callback(lambda task: task.cancelled() or task.exception())
    if not landed:
        return outcomes
    seconds, now = time.perf_counter() - started, time.monotonic()
    owner = PrefetchBuffer(staging, buffer, 0)
    for (index, plan, at), done in served:
        outcomes[index] = _held(grants[index][0], plan, at, done, message, seconds, now, integrity, peer.address, owner)
    if owner.holders == 0:
        staging.give(buffer)
    return outcomes


def _held(grant: PrefillGrant, plan: TransferPlan, at: int, done: pb.PullDone, message: torch.Tensor, seconds: float,
          now: float, integrity: bool, address: str, owner: PrefetchBuffer) -> Prefetched | StatusError:
    """A served grant's entry (one more holder of ``owner``), or DATA_LOSS where its PullDone disagrees with the plan
    (or its crc32s with the bytes, with ``integrity``)."""
    if done.bytes != plan.total_bytes or done.regions != len(plan):
        return StatusError(grpc.StatusCode.DATA_LOSS, f"prefetch from {address}: PullDone states {done.bytes} bytes "
                           f"in {done.regions} regions, the plan {plan.total_bytes} in {len(plan)}")
    data = message[at:at + plan.total_bytes]
    if integrity:
        if list(done.crc32) != regions.back_to_back_crc32s(data, [pair.src.nbytes for pair in plan.pairs]):
            return StatusError(grpc.StatusCode.DATA_LOSS, f"prefetch from {address}: a region's crc32 differs from "
                               "the prefill node's")
    owner.holders += 1
    entry = Prefetched(grant_id=grant.grant_id, nbytes=plan.total_bytes, regions=len(plan), seconds=seconds,
                       landed_at=now, data=data, owner=owner)
    where = 0
    for pair in plan.pairs:
        entry.add(pair.src, where)
        where += pair.src.nbytes
    return entry
