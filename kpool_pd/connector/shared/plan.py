"""Transfer plans: a request's blocks and ring as a few contiguous byte regions on each side.

Pure functions of the layout and the ids; both nodes compute the same plan, so the decode
node never writes where the prefill node tells it to. Offsets are into the flat pool buffers
(``pool.block_plane(region.plane)`` for ``PoolKind.BLOCKS``, ``CachePool.rings.view(-1)`` for
``PoolKind.RINGS``). The unified layout has one plane (a block is one byte range); an engine that
keeps a tensor per layer (``kvcache.PlanarLayout``) has several, and a run of blocks is then one
region in each. Such an engine may keep several block tables per request (``layout.num_groups``
``G``): id ``v`` is then block ``v // G`` of group ``v % G``, a run is ids ``G`` apart (one group's
consecutive blocks), and it moves in the planes that hold that group (``layout.plane_groups``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kpool_pd.kvcache import BlockLayout, CacheConfig


class PoolKind(enum.Enum):
    """Which pool a region lies in; values match ``kpoolpd.v1.PoolKind``."""

    BLOCKS = 1
    RINGS = 2


@dataclass(frozen=True, slots=True)
class RingRange:
    """``num_slots`` consecutive ring slots starting at ``start_slot`` (mod the slot count).
    ``num_slots == 0`` is the explicit empty ring."""

    start_slot: int
    num_slots: int

    @property
    def empty(self) -> bool:
        return self.num_slots == 0


@dataclass(frozen=True, slots=True)
class Region:
    kind: PoolKind
    offset: int
    nbytes: int
    plane: int = 0  # which block plane (``layout.block_planes``) the offset is into; 0 for rings


@dataclass(frozen=True, slots=True)
class RegionPair:
    src: Region
    dst: Region


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Block runs first (in block-table order), then the ring as zero, one or two pieces."""

    pairs: tuple[RegionPair, ...]
    ring_empty: bool

    @property
    def total_bytes(self) -> int:
        return sum(p.src.nbytes for p in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)


def ring_live_range(config: CacheConfig, prompt_len: int) -> RingRange:
    """The ring slots that hold live state after ``prompt_len`` committed tokens.

    Positions ``[config.open_entry_start(L), L)``: the open pool (kpool family) or open group
    (QSA). Position ``pos`` is at slot ``pos % ring_slots``. Empty (``num_slots == 0``) when L is
    a multiple of kpool (or r).
    """
    if not isinstance(prompt_len, int) or prompt_len < 0:
        raise ValueError(f"prompt_len must be an integer >= 0, got {prompt_len!r}")
    start = config.open_entry_start(prompt_len)
    count = prompt_len - start
    return RingRange(start_slot=start % config.ring_slots if count else 0, num_slots=count)


def check_ids(name: str, ids: Sequence[int], limit: int | None) -> None:
    """ValueError naming the id for an id outside [0, limit) (no bound when ``limit`` is None) or one given twice."""
    limit = limit or 1 << 62
    seen: set[int] = set()
    for i in ids:
        if not isinstance(i, int) or not 0 <= i < limit:
            raise ValueError(f"{name}: id {i!r} outside [0, {limit})")
        if i in seen:
            raise ValueError(f"{name}: id {i} appears twice")
        seen.add(i)


def without_held(src_blocks: Sequence[int], dst_blocks: Sequence[int],
                 held: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(src, dst)`` without the block-table indices ``held`` (blocks the destination already holds: a
    prefix-cache hit). ValueError naming the index for one out of order, repeated or beyond the blocks."""
    last = -1
    for index in held:
        if not isinstance(index, int) or not last < index < len(src_blocks):
            raise ValueError(f"held block index {index!r}: indices must increase and lie below the "
                             f"{len(src_blocks)} blocks of the grant")
        last = index
    skip = set(held)
    keep = [i for i in range(len(src_blocks)) if i not in skip]
    return [src_blocks[i] for i in keep], [dst_blocks[i] for i in keep]


def plan_transfer(
    layout: BlockLayout,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    src_ring: int,
    dst_ring: int,
    live: RingRange,
    *,
    src_num_blocks: int | None = None,
    dst_num_blocks: int | None = None,
    src_num_rings: int | None = None,
    dst_num_rings: int | None = None,
    piece_blocks: int = 0,
) -> TransferPlan:
    """Region pairs that copy ``src_blocks[i] -> dst_blocks[i]`` and the ring's live slots.

    Consecutive entries are merged into one region where BOTH sides are consecutive (ids ``G`` apart
    for a layout of ``G`` groups: one group's consecutive blocks), and, with
    ``piece_blocks > 0``, not across a block-table index that is a multiple of ``piece_blocks`` (a
    pipelined transfer moves each piece once the prompt's chunks have written all of it). The pool
    sizes, when given, bound the ids (ValueError naming the id otherwise).
    """
    if not isinstance(piece_blocks, int) or piece_blocks < 0:
        raise ValueError(f"piece_blocks must be an integer >= 0, got {piece_blocks!r}")
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    check_ids("source blocks", src_blocks, src_num_blocks)
    check_ids("destination blocks", dst_blocks, dst_num_blocks)
    check_ids("source ring", [src_ring], src_num_rings)
    check_ids("destination ring", [dst_ring], dst_num_rings)
    if not 0 <= live.num_slots <= layout.ring_slots or (live.num_slots and not 0 <= live.start_slot < layout.ring_slots):
        raise ValueError(f"ring range {live} does not fit a ring of {layout.ring_slots} slots")

    groups = layout.num_groups
    mixed = [(s, d) for s, d in zip(src_blocks, dst_blocks) if s % groups != d % groups]
    if mixed:
        raise ValueError(f"source and destination blocks of different groups (of {groups}): {mixed[:4]}")
    pairs: list[RegionPair] = []
    i = 0
    while i < len(src_blocks):
        j = i + 1
        while (j < len(src_blocks) and src_blocks[j] == src_blocks[j - 1] + groups
               and dst_blocks[j] == dst_blocks[j - 1] + groups and not (piece_blocks and j % piece_blocks == 0)):
            j += 1
        group, src_block, dst_block = src_blocks[i] % groups, src_blocks[i] // groups, dst_blocks[i] // groups
        for plane, bb in enumerate(layout.block_planes):  # a run is one region in each of its group's planes
            if group not in layout.plane_groups[plane]:
                continue
            n = (j - i) * bb
            pairs.append(RegionPair(Region(PoolKind.BLOCKS, src_block * bb, n, plane),
                                    Region(PoolKind.BLOCKS, dst_block * bb, n, plane)))
        i = j

    slot_bytes = layout.ring_slot_bytes
    first = min(live.num_slots, layout.ring_slots - live.start_slot)
    pieces = [(live.start_slot, first), (0, live.num_slots - first)]
    for slot, count in pieces:
        if count == 0:
            continue
        n = count * slot_bytes
        src = Region(PoolKind.RINGS, src_ring * layout.ring_block_bytes + slot * slot_bytes, n)
        dst = Region(PoolKind.RINGS, dst_ring * layout.ring_block_bytes + slot * slot_bytes, n)
        pairs.append(RegionPair(src, dst))
    return TransferPlan(pairs=tuple(pairs), ring_empty=live.empty)
