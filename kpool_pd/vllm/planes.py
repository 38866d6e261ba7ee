"""vLLM's KV cache allocation (``register_kv_caches``) as the planes the connector moves (``kvcache.PlanarPool``).

vLLM allocates one backing buffer and places every layer in it as ``KVCacheConfig.kv_cache_tensors``
says (``vllm/v1/worker/utils.py: allocate_kv_cache``): layer ``l`` of a ``KVCacheTensor`` holds block
``b`` at ``offset + l * layer_stride + b * block_stride`` bytes, and the tensors of different KV cache
groups overlay each other (a block id belongs to one group at a time). The planes follow that placement:

- layer-outermost layouts (``block_stride <= layer_stride``): each layer is its own region, one plane per
  layer (one per index of the dimensions stored between the layer and the block, e.g. the heads of
  ``LHBNC``) holding block ``b`` at ``b * block_stride``; the plane belongs to its layer's group.
- block-outermost layouts (``block_stride > layer_stride``): block ``b`` is the byte range
  ``[b * block_stride, (b + 1) * block_stride)`` of the buffer, every layer of every group packed in it;
  the whole buffer is one plane that every such group's blocks lie in.

Either way a run of a request's consecutive blocks is one region per plane: a few regions per layer at
most, never one per block. The layout's description (what its hash covers) names the layout, each
group's spec (its kind, dtype, block size, page size: every field), its layers, and each tensor's place
in a block; the number of blocks each engine keeps may differ.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
from collections.abc import Mapping, Sequence
from fractions import Fraction

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor, compute_layout_strides
from vllm.v1.kv_cache_layout import KVCacheLayout

from kpool_pd.vllm.groups import GroupRule, layer_spec
from kpool_pd.kvcache import PlanarCacheConfig, PlanarLayout, PlanarPool

_DIM_L, _DIM_B = 0, 1  # vLLM's logical [L, B, H, N, C] axes


def described(value: object) -> object:
    """A spec field as JSON: dtypes and enums by name, fractions as text, nested specs field by field."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, Fraction):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return describe_spec(value)
    if isinstance(value, Mapping):
        return {str(k): described(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [described(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def describe_spec(spec) -> dict:
    """Every field of a vLLM ``KVCacheSpec`` and its page size: what two engines' groups must agree on."""
    fields = {f.name: described(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
    return {"kind": type(spec).__name__, "page_size_bytes": spec.page_size_bytes, "fields": fields}


def backing_buffer(kv_caches: Mapping[str, torch.Tensor], layers: Sequence[str]) -> torch.Tensor:
    """uint8 [nbytes]: the one allocation every layer of ``layers`` views (vLLM allocates one). ValueError
    naming the layer for a layer missing from ``kv_caches`` or held in another allocation."""
    missing = [name for name in layers if name not in kv_caches]
    if missing:
        raise ValueError(f"register_kv_caches: no cache for layers {missing[:4]} of the KV cache config")
    first = kv_caches[layers[0]]
    storage = first.untyped_storage()
    others = [name for name in layers if kv_caches[name].untyped_storage().data_ptr() != storage.data_ptr()]
    if others:
        raise ValueError(f"layers {others[:4]} are not in the allocation of layer {layers[0]}: KpoolPdConnector "
                         "moves the one backing buffer vLLM allocates (vllm.v1.worker.utils.allocate_kv_cache)")
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage).view(-1)


def _layer_outer_planes(tensor: KVCacheTensor, spec, layout: KVCacheLayout,
                        num_blocks: int) -> list[tuple[int, dict]]:
    """(byte start, description) of each plane of a layer-outermost tensor: one per layer and per index
    of the dimensions stored between the layer and block dimensions."""
    strides = compute_layout_strides(spec, num_blocks, len(tensor.layers), layout,
                                     fixed_strides=(tensor.layer_stride, tensor.block_stride, None, None, None))
    shape = (len(tensor.layers), num_blocks, spec.num_heads, spec.num_states, spec.state_content_size_bytes)
    order = layout.stride_order
    between = order[order.index(_DIM_L) + 1:order.index(_DIM_B)]
    planes = []
    for layer in range(len(tensor.layers)):
        for index in itertools.product(*(range(shape[d]) for d in between)):
            start = tensor.offset + layer * strides[_DIM_L] + sum(i * strides[d] for i, d in zip(index, between))
            planes.append((start, {"layer": tensor.layers[layer], "index": list(index)}))
    return planes


def engine_pool(kv_caches: Mapping[str, torch.Tensor], config: KVCacheConfig, layout: KVCacheLayout,
                rules: Sequence[GroupRule], *, engine: Mapping[str, object]) -> PlanarPool:
    """The pool of vLLM's caches ``kv_caches`` (layer name to view) placed as ``config`` says in
    ``layout``, holding the groups of ``rules`` (the groups moved); ``engine`` (JSON values) joins the
    description. ValueError naming the layer or tensor that does not fit."""
    moved = {rule.group: rule for rule in rules}
    if not moved:
        raise ValueError("no KV cache group to move")
    tensors = [(t, next(g for g in moved if t.layers[0] in config.kv_cache_groups[g].layer_names))
               for t in config.kv_cache_tensors
               if any(t.layers[0] in config.kv_cache_groups[g].layer_names for g in moved)]
    buffer = backing_buffer(kv_caches, [name for t, _ in tensors for name in t.layers])
    num_blocks = config.num_blocks
    planes: dict[tuple[int, int], list] = {}  # (start, block bytes) -> [groups, descriptions]
    placed = []
    for tensor, group in tensors:
        spec = layer_spec(config.kv_cache_groups[group].kv_cache_spec, tensor.layers[0])
        if config.num_blocks_of(tensor) != num_blocks:
            raise ValueError(f"tensor of layers {tensor.layers[:4]} keeps its own block pool; only the shared pool moves")
        if tensor.block_stride > tensor.layer_stride:  # block-outermost: the block is one byte range of the buffer
            starts = [(0, {"block": "whole"})]
            placed.append({"group": group, "layers": tensor.layers, "offset": tensor.offset,
                           "layer_stride": tensor.layer_stride})
        else:
            starts = _layer_outer_planes(tensor, spec, layout, num_blocks)
            placed.append({"group": group, "layers": tensor.layers})
        for start, about in starts:
            entry = planes.setdefault((start, tensor.block_stride), [set(), []])
            entry[0].add(group)
            entry[1].append(about)
    views, plane_bytes, plane_groups = [], [], []
    for (start, block_bytes), (groups, _) in sorted(planes.items()):
        end = start + num_blocks * block_bytes
        if end > buffer.numel():
            raise ValueError(f"a plane of {num_blocks} blocks of {block_bytes} bytes from byte {start} "
                             f"passes the end of the {buffer.numel()}-byte allocation")
        views.append(buffer[start:end])
        plane_bytes.append(block_bytes)
        plane_groups.append(tuple(sorted(groups)))
    num_groups = len(config.kv_cache_groups)
    description = json.dumps({
        "engine": dict(engine), "layout": layout.name, "num_groups": num_groups,
        "groups": [{"group": r.group, "kind": r.kind.value, "layers": list(config.kv_cache_groups[r.group].layer_names),
                    "spec": describe_spec(config.kv_cache_groups[r.group].kv_cache_spec)} for r in rules],
        "tensors": placed,
        "planes": [{"groups": sorted(groups), "holds": about} for _, (groups, about) in sorted(planes.items())],
    }, sort_keys=True)
    block_size = min(r.block_size for r in rules)
    cache = PlanarCacheConfig(block_size=block_size, plane_block_bytes=tuple(plane_bytes), description=description,
                              num_groups=num_groups, plane_groups=tuple(plane_groups) if num_groups > 1 else ())
    return PlanarPool(PlanarLayout(cache), views, num_blocks=num_blocks)
