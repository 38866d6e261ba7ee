"""A cache whose memory an outside engine (vLLM) allocated and owns, seen as **planes**.

The unified layout keeps a block's every layer in one byte range. An engine such as vLLM keeps one
tensor per layer (and within it, K and V apart): block ``b`` of a request then lies in every one of
those buffers. Each such buffer is a plane: a flat byte buffer that holds block ``b`` at
``b * plane_block_bytes``. A transfer of a run of consecutive blocks is one region per plane, so a
request still moves as a few large regions per layer.

``PlanarCacheConfig`` and ``PlanarLayout`` answer what the connector asks of a layout (the layout
hash, blocks for a prompt, the empty ring: such an engine keeps no ring); ``PlanarPool`` holds the
planes. The engine describes its cache (layer names, shapes, dtypes, specs) in ``description``,
which the layout hash covers, so two engines exchange blocks only when their caches mean the same.

**Groups.** An engine may keep several block tables per request (vLLM's KV cache groups: full and
sliding-window attention, an indexer, a per-request ring), all drawing block ids from one pool of
``blocks_per_plane`` blocks. Each plane holds the blocks of some of the groups (``plane_groups``). The
connector names a block by one id: with ``G`` groups, id ``v`` is block ``v // G`` of group ``v % G``
(``PlanarLayout.block_id``), so a run of a group's consecutive blocks is a run of ids ``G`` apart, moved
as one region in each of that group's planes. One group (``G == 1``) is the plain block id.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from collections.abc import Sequence

import torch

from kpool_pd.kvcache.config import LAYOUT_FORMAT_VERSION
from kpool_pd.kvcache.family import Count, check_count


@dataclass(frozen=True, kw_only=True)
class PlanarCacheConfig:
    """``block_size`` tokens a block; ``plane_block_bytes[i]`` bytes of a block in plane ``i``;
    ``description``: the engine's canonical JSON of everything that changes what the bytes mean;
    ``num_groups`` block tables per request and ``plane_groups[i]`` the groups whose blocks plane ``i``
    holds (empty: one group, in every plane)."""

    block_size: int
    plane_block_bytes: tuple[int, ...]
    description: str
    num_groups: int = 1
    plane_groups: tuple[tuple[int, ...], ...] = ()
    format_version: int = LAYOUT_FORMAT_VERSION

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not self.plane_block_bytes or any(type(n) is not int or n <= 0 for n in self.plane_block_bytes):
            raise ValueError(f"plane_block_bytes must be positive integers, got {self.plane_block_bytes!r}")
        try:
            described = json.loads(self.description)
        except json.JSONDecodeError as exc:
            raise ValueError(f"description must be JSON: {exc}") from None
        if not isinstance(described, dict):
            raise ValueError("description must be a JSON object")
        if type(self.num_groups) is not int or self.num_groups <= 0:
            raise ValueError(f"num_groups must be a positive integer, got {self.num_groups!r}")
        if self.plane_groups or self.num_groups > 1:
            if len(self.plane_groups) != len(self.plane_block_bytes):
                raise ValueError(f"plane_groups names {len(self.plane_groups)} planes for "
                                 f"{len(self.plane_block_bytes)} planes of {self.num_groups} groups")
            for index, groups in enumerate(self.plane_groups):
                if not groups or any(type(g) is not int or not 0 <= g < self.num_groups for g in groups):
                    raise ValueError(f"plane {index} holds groups {groups!r}; each plane holds one or more "
                                     f"of groups 0..{self.num_groups - 1}")

    ring_slots = 0  # no per-request ring: the engine's caches are all paged

    def blocks_for_tokens(self, num_tokens: Count) -> Count:
        """Blocks that hold positions ``[0, num_tokens)``: ceil(num_tokens / block_size), as CacheConfig counts."""
        check_count("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)

    def open_entry_start(self, num_tokens: Count) -> Count:
        """Every position is in a block: no open entry waits in a ring."""
        return num_tokens

    def hash_fields(self) -> dict[str, object]:
        fields = json.loads(self.description) | {
            "block_size": self.block_size,
            "plane_block_bytes": list(self.plane_block_bytes),
            "format_version": self.format_version,
        }
        if self.num_groups > 1:
            fields |= {"num_groups": self.num_groups, "plane_groups": [list(g) for g in self.plane_groups]}
        return fields


class PlanarLayout:
    """The layout of a ``PlanarCacheConfig``, as the connector reads a layout: ``block_planes`` (bytes
    of a block in each plane), ``block_bytes`` (their sum), no ring bytes, and the layout hash."""

    ring_slots = 0
    ring_slot_bytes = 0
    ring_block_bytes = 0

    def __init__(self, config: PlanarCacheConfig) -> None:
        self.config = config
        self.block_planes: tuple[int, ...] = config.plane_block_bytes
        self.block_bytes = sum(config.plane_block_bytes)
        self.num_groups = config.num_groups
        self.plane_groups: tuple[tuple[int, ...], ...] = config.plane_groups or ((0,),) * len(config.plane_block_bytes)

    def block_id(self, group: int, block: int) -> int:
        """The connector's id of the engine's block ``block`` of group ``group``."""
        if not 0 <= group < self.num_groups or block < 0:
            raise ValueError(f"no block {block} of group {group} in a layout of {self.num_groups} groups")
        return block * self.num_groups + group

    def split_id(self, block_id: int) -> tuple[int, int]:
        """(group, engine block) of the connector's id ``block_id``."""
        return block_id % self.num_groups, block_id // self.num_groups

    @functools.cached_property
    def layout_hash(self) -> str:  # once: the config is frozen, and a pull reads it more than once
        canonical = json.dumps(self.config.hash_fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def describe(self) -> dict[str, object]:
        return self.config.hash_fields() | {"block_bytes": self.block_bytes, "layout_hash": self.layout_hash}


class PlanarPool:
    """The planes of an engine's cache: ``planes[i]`` is uint8 ``[num_blocks * block_planes[i]]``,
    aliasing the engine's tensors (no copy; planes of different groups may alias each other, as vLLM's
    groups overlay one allocation). No rings (``num_rings`` 0). ``num_blocks`` here counts the
    connector's ids (``blocks_per_plane * layout.num_groups``)."""

    def __init__(self, layout: PlanarLayout, planes: Sequence[torch.Tensor], *, num_blocks: int) -> None:
        if type(num_blocks) is not int or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if len(planes) != len(layout.block_planes):
            raise ValueError(f"{len(planes)} planes for a layout of {len(layout.block_planes)}")
        devices = {p.device for p in planes}
        if len(devices) != 1:
            raise ValueError(f"planes must share one device, got {sorted(map(str, devices))}")
        for index, (plane, nbytes) in enumerate(zip(planes, layout.block_planes)):
            if plane.dtype != torch.uint8 or plane.dim() != 1 or not plane.is_contiguous() \
                    or plane.numel() != num_blocks * nbytes:
                raise ValueError(f"plane {index} must be a contiguous uint8 [{num_blocks * nbytes}] view, "
                                 f"got {plane.dtype} {tuple(plane.shape)}")
        self.layout = layout
        self.config = layout.config
        self.blocks_per_plane = num_blocks
        self.num_blocks = num_blocks * layout.num_groups
        self.num_rings = 0
        self.planes = tuple(planes)
        self.rings = torch.empty(0, dtype=torch.uint8, device=self.planes[0].device)

    @property
    def device(self) -> torch.device:
        return self.planes[0].device

    def block_plane(self, index: int) -> torch.Tensor:
        """uint8 [num_blocks * block_planes[index]]: plane ``index``, flat."""
        return self.planes[index]
