"""The plan a decode node sent with its pull, checked on the prefill node against the grant and this node's
layout, and served as it is: the prefill node plans nothing.

The decode node planned the pull once from the Prefill response (``kpool_pd.connector.decode.share``) and
sends the source side of each region, in order. A region is served only if every byte of it lies in what
the grant holds: its blocks (a block region in a plane that holds the block's group, ``layout.plane_groups``)
or its ring's live slots. What a region waits for on a grant still computing follows from the blocks it
covers: the block-table index of the last one (``ready``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.leases import Grant
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.plan import PoolKind, Region
from kpool_pd.connector.shared.ucx import MAX_REGIONS
from kpool_pd.connector.shared.wire import region_from
from kpool_pd.kvcache import BlockLayout


@dataclass(frozen=True)
class ServedPlan:
    """The regions of one pull, in the order the decode node receives them, and for each how many prompt
    tokens must be written in every layer before it may move."""

    regions: tuple[Region, ...]
    ready: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    def __len__(self) -> int:
        return len(self.regions)


def served_plan(layout: BlockLayout, grant: Grant, regions: Sequence[pb.Region]) -> ServedPlan:
    """The pull's regions, each checked against ``grant`` held in ``layout``. StatusError INVALID_ARGUMENT
    naming the region for one that is empty, of an unknown pool or plane, or reaches outside the grant, and
    for more than ``MAX_REGIONS``."""
    if len(regions) > MAX_REGIONS:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{len(regions)} regions (limit {MAX_REGIONS})")
    index = {block: i for i, block in enumerate(grant.block_ids)}  # block id -> block-table index
    ring = _ring_spans(layout, grant)
    checked, ready = [], []
    for i, message in enumerate(regions):
        try:
            region = region_from(message)
        except ValueError as exc:
            raise _outside(i, message, str(exc)) from None
        if region.nbytes <= 0:
            raise _outside(i, message, "it is empty")
        if region.kind is PoolKind.RINGS:
            if region.plane != 0 or not any(start <= region.offset and region.offset + region.nbytes <= end
                                             for start, end in ring):
                raise _outside(i, message, f"the grant's ring holds bytes {ring or 'none'} (plane 0)")
            ready.append(grant.prompt_len)
        else:
            last = _last_block_index(layout, index, region)
            if last is None:
                raise _outside(i, message, "it reaches bytes of a block the grant does not hold")
            whole = layout.num_groups > 1  # blocks of several groups are not in token order
            ready.append(grant.prompt_len if whole else min(grant.prompt_len, (last + 1) * layout.config.block_size))
        checked.append(region)
    return ServedPlan(regions=tuple(checked), ready=tuple(ready))


def _ring_spans(layout: BlockLayout, grant: Grant) -> list[tuple[int, int]]:
    """The byte ranges of the ring pool that hold the grant's live slots: none, one, or two (it wraps)."""
    live, slots, slot_bytes = grant.live, layout.ring_slots, layout.ring_slot_bytes
    base = grant.ring_id * layout.ring_block_bytes
    first = min(live.num_slots, slots - live.start_slot) if live.num_slots else 0
    pieces = [(live.start_slot, first), (0, live.num_slots - first)]
    return [(base + slot * slot_bytes, base + (slot + count) * slot_bytes) for slot, count in pieces if count > 0]


def _last_block_index(layout: BlockLayout, index: dict[int, int], region: Region) -> int | None:
    """The largest block-table index of the grant's blocks that ``region`` covers, or None when it covers a
    byte of a block (of a group its plane holds) the grant does not hold, or a plane this layout lacks."""
    if not 0 <= region.plane < len(layout.block_planes):
        return None
    block_bytes, groups = layout.block_planes[region.plane], layout.num_groups
    held_groups = layout.plane_groups[region.plane]
    last = -1
    for block in range(region.offset // block_bytes, (region.offset + region.nbytes - 1) // block_bytes + 1):
        found = [index[v] for v in (block * groups + g for g in held_groups) if v in index]
        if not found:
            return None
        last = max(last, *found)
    return last


def _outside(i: int, message: pb.Region, why: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"region {i} (pool {message.kind}, plane {message.plane}, "
                       f"bytes {message.offset}+{message.nbytes}) is not served: {why}")
