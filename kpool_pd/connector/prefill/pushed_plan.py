"""The plan of a push (``PrefillPush``), checked on the prefill node before the prompt runs and bound to the
grant once its blocks are allocated.

A decode node that pushes plans before any block is allocated here, so it names the source side relative to
the grant: a block region covers whole blocks of the grant's block table (block-table index ``i`` at ``i`` times
the plane's block bytes), a ring region lies in the grant's ring block. Both follow from the prompt's length
alone (how many blocks it fills, which ring slots stay live), so ``check_pushed`` checks every region before
the prompt runs (a grant is checked before the prefill's end, not after). ``bind_pushed`` then maps each region
onto the blocks the engine allocated: a region whose blocks lie together is a view of the pool, one whose blocks
do not is gathered into one buffer once the prompt has written them (the decode node posted one receive for it).
What a region waits for follows from the blocks it covers, as for a pull (``served_plan``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc
import torch

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.leases import Grant
from kpool_pd.connector.prefill.served_plan import ServedPlan
from kpool_pd.connector.shared import regions as pool_regions
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.plan import PoolKind, Region, ring_live_range
from kpool_pd.connector.shared.ucx import MAX_REGIONS
from kpool_pd.connector.shared.wire import region_from
from kpool_pd.kvcache import BlockLayout, CachePool

SourceView = torch.Tensor | Callable[[], torch.Tensor]  # a region's bytes, or the gather that copies them together


def check_pushed(layout: BlockLayout, prompt_len: int, messages: Sequence[pb.Region]) -> tuple[Region, ...]:
    """The push's regions, relative to the grant a ``prompt_len``-token prompt makes in ``layout``. StatusError
    INVALID_ARGUMENT naming the region for one that is empty, of an unknown pool or plane, not whole blocks, or
    beyond the prompt's blocks or its ring's live slots, and for more than ``MAX_REGIONS``; FAILED_PRECONDITION
    for a layout of several block tables a request (it does not take pushes)."""
    if layout.num_groups != 1:
        raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"this node keeps {layout.num_groups} block tables a "
                          f"request and takes no push; use Prefill and Pull")
    if len(messages) > MAX_REGIONS:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{len(messages)} regions (limit {MAX_REGIONS})")
    blocks = layout.config.blocks_for_tokens(prompt_len)
    spans = _relative_ring_spans(layout, prompt_len)
    checked = []
    for i, message in enumerate(messages):
        try:
            region = region_from(message)
        except ValueError as exc:
            raise _refused(i, message, str(exc)) from None
        if region.nbytes <= 0:
            raise _refused(i, message, "it is empty")
        if region.kind is PoolKind.RINGS:
            if region.plane != 0 or not any(a <= region.offset and region.offset + region.nbytes <= b for a, b in spans):
                raise _refused(i, message, f"the grant's ring holds bytes {spans or 'none'} of its ring block (plane 0)")
        else:
            if not 0 <= region.plane < len(layout.block_planes):
                raise _refused(i, message, f"this layout has {len(layout.block_planes)} block planes")
            size = layout.block_planes[region.plane]
            if region.offset % size or region.nbytes % size or (region.offset + region.nbytes) // size > blocks:
                raise _refused(i, message, f"a block region covers whole blocks of the grant's {blocks} "
                               f"({size} bytes each in plane {region.plane})")
        checked.append(region)
    return tuple(checked)


def bind_pushed(pool: CachePool, grant: Grant, relative: Sequence[Region]) -> tuple[ServedPlan, list[SourceView]]:
    """The checked regions (``check_pushed``) on ``grant``'s blocks and ring: the plan (its regions as the
    decode node named them, and when each may move) and each region's source view."""
    layout = pool.layout
    views: list[SourceView] = []
    ready: list[int] = []
    for region in relative:
        if region.kind is PoolKind.RINGS:
            absolute = Region(PoolKind.RINGS, grant.ring_id * layout.ring_block_bytes + region.offset, region.nbytes)
            views.append(pool_regions.region_view(pool, absolute))
            ready.append(grant.prompt_len)
            continue
        size = layout.block_planes[region.plane]
        first, count = region.offset // size, region.nbytes // size
        runs = _runs(grant.block_ids[first:first + count])
        pieces = [Region(PoolKind.BLOCKS, start * size, length * size, region.plane) for start, length in runs]
        views.append(pool_regions.region_view(pool, pieces[0]) if len(pieces) == 1 else _gather(pool, pieces))
        ready.append(min(grant.prompt_len, (first + count) * layout.config.block_size))
    return ServedPlan(regions=tuple(relative), ready=tuple(ready)), views


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, length) of each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def _gather(pool: CachePool, pieces: list[Region]) -> Callable[[], torch.Tensor]:
    """The copy of ``pieces`` laid together (uint8 [sum of their bytes]), made when called (once the prompt wrote
    them) and complete when it returns."""
    def gather() -> torch.Tensor:
        out = torch.cat([pool_regions.region_view(pool, piece) for piece in pieces])
        if out.device.type == "cuda":
            torch.cuda.current_stream(out.device).synchronize()
        return out
    return gather


def _relative_ring_spans(layout: BlockLayout, prompt_len: int) -> list[tuple[int, int]]:
    """The byte ranges of a ring block that hold a ``prompt_len``-token prompt's live slots: none, one or two."""
    live, slots, slot_bytes = ring_live_range(layout.config, prompt_len), layout.ring_slots, layout.ring_slot_bytes
    first = min(live.num_slots, slots - live.start_slot) if live.num_slots else 0
    pieces = [(live.start_slot, first), (0, live.num_slots - first)]
    return [(slot * slot_bytes, (slot + count) * slot_bytes) for slot, count in pieces if count > 0]


def _refused(i: int, message: pb.Region, why: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"pushed region {i} (pool {message.kind}, plane "
                       f"{message.plane}, bytes {message.offset}+{message.nbytes}) is not served: {why}")
