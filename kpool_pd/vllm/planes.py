"""vLLM's per-layer caches (``register_kv_caches``) as the planes the connector moves (``kvcache.PlanarPool``).

vLLM gives one tensor per layer, shaped by its attention backend (e.g. ``[2, num_blocks, ...]``: K and V
apart), possibly a permuted view of its storage. Read in memory order, such a tensor is
``[planes..., num_blocks, per-block...]``: every index of the dimensions stored before the block
dimension is a plane, a flat buffer holding block ``b`` at ``b * block_bytes``. A request's run of
consecutive blocks is then one region per plane: a few regions per layer, never one per block.

The layout's description (what its hash covers) names each layer's shape with the block dimension
left out, its dtype and its storage order, and the block size: two engines exchange blocks only when
these agree (the number of blocks each keeps may differ).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from kvcache import PlanarCacheConfig, PlanarLayout, PlanarPool


def layer_planes(name: str, cache: torch.Tensor, num_blocks: int) -> tuple[list[torch.Tensor], int, dict]:
    """One layer's planes (uint8 ``[num_blocks * block_bytes]`` views, no copy), the bytes a block takes
    in each, and the layer's description. ValueError naming the layer for a tensor that has no block
    dimension or whose blocks are not contiguous byte ranges."""
    # cache: any dtype, one dimension of num_blocks (the first such), dense in some dimension order
    dims = [d for d in range(cache.dim()) if cache.shape[d] == num_blocks]
    if not dims:
        raise ValueError(f"layer {name}: no dimension of {num_blocks} blocks in shape {tuple(cache.shape)}")
    block_dim = dims[0]
    order = sorted(range(cache.dim()), key=lambda d: (-cache.stride(d), d))
    stored = cache.permute(order)
    if not stored.is_contiguous():
        raise ValueError(f"layer {name}: shape {tuple(cache.shape)} with strides {cache.stride()} is not dense")
    at = order.index(block_dim)
    num_planes = 1
    for d in order[:at]:
        num_planes *= cache.shape[d]
    flat = stored.reshape(-1).view(torch.uint8).view(num_planes, -1)
    block_bytes = flat.shape[1] // num_blocks
    shape = [-1 if d == block_dim else n for d, n in enumerate(cache.shape)]
    described = {"name": name, "shape": shape, "dtype": str(cache.dtype).removeprefix("torch."), "order": order}
    return list(flat.unbind(0)), block_bytes, described


def planar_pool(caches: Mapping[str, torch.Tensor], *, num_blocks: int, block_size: int,
                engine: Mapping[str, object]) -> PlanarPool:
    """The pool of an engine's layers ``caches`` (layer name to tensor, in the engine's order) of
    ``num_blocks`` blocks of ``block_size`` tokens; ``engine`` (JSON values) joins the description."""
    if not caches:
        raise ValueError("no KV caches to register")
    planes: list[torch.Tensor] = []
    plane_bytes: list[int] = []
    layers = []
    for name, cache in caches.items():
        views, block_bytes, described = layer_planes(name, cache, num_blocks)
        planes += views
        plane_bytes += [block_bytes] * len(views)
        layers.append(described)
    description = json.dumps({"engine": dict(engine), "layers": layers}, sort_keys=True)
    config = PlanarCacheConfig(block_size=block_size, plane_block_bytes=tuple(plane_bytes), description=description)
    return PlanarPool(PlanarLayout(config), planes, num_blocks=num_blocks)
