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
most, never one per block.

**Head units.** Where TP splits every moved cache by KV head and vLLM lays a layer's block out as
``[heads, tokens, content]`` in one run (``LBHNC``, unpadded pages), the pool names each head slot of a
block by an id of its own (``head_units``): a plane's "block" is one head's ``[tokens, content]``, unit
``b * units + h`` of the plane is slot ``h`` of vLLM block ``b`` (``kpool_pd.vllm.units``). A consumer rank
then reads just the heads it holds from the producer rank that holds them, whatever the two engines' TP
sizes: the description names each layer's spec for one head, so ranks of any TP agree on it. Such a pool
keeps at least two groups' ids (a model of one group gets an empty second one), so that the connector
counts a pull's blocks by the grant's ids rather than by the prompt's tokens.

The layout's description (what its hash covers) names the layout, each group's spec (its kind, dtype,
block size, page size: every field; with head units, each layer's for one head), its layers, and each
tensor's place in a block; the number of blocks each engine keeps may differ.
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

from kpool_pd.vllm.groups import GroupRule, layer_spec, splits_by_head
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


def head_units(config: KVCacheConfig, layout: KVCacheLayout, rules: Sequence[GroupRule]) -> int:
    """The head slots of each block when a pool of ``config``'s groups of ``rules`` can name each by an id
    of its own (every moved layer split by head with one head count, vLLM's ``LBHNC`` layout, unpadded
    pages); 0 when it moves whole blocks."""
    if layout is not KVCacheLayout.LBHNC:
        return 0
    heads = set()
    for rule in rules:
        group = config.kv_cache_groups[rule.group]
        for layer in group.layer_names:
            spec = layer_spec(group.kv_cache_spec, layer)
            if not splits_by_head(spec) or getattr(spec, "page_size_padded", None) is not None:
                return 0
            heads.add(spec.num_heads)
    return heads.pop() if len(heads) == 1 else 0


def _one_head(spec) -> dict:
    """A layer's spec described for one of its KV heads (the same on every TP rank)."""
    return describe_spec(dataclasses.replace(spec, num_kv_heads=1))


def engine_pool(kv_caches: Mapping[str, torch.Tensor], config: KVCacheConfig, layout: KVCacheLayout,
                rules: Sequence[GroupRule], *, engine: Mapping[str, object], units: int = 0) -> PlanarPool:
    """The pool of vLLM's caches ``kv_caches`` (layer name to view) placed as ``config`` says in
    ``layout``, holding the groups of ``rules`` (the groups moved); ``engine`` (JSON values) joins the
    description. ``units``: ``head_units``' answer, the head slots a block holds, each then an id of its
    own (0: whole blocks). ValueError naming the layer or tensor that does not fit."""
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
        if units:
            if tensor.block_stride != spec.page_size_bytes or tensor.block_stride % units:
                raise ValueError(f"tensor of layers {tensor.layers[:4]}: a block of {tensor.block_stride} bytes is "
                                 f"not {units} head slots of its {spec.page_size_bytes}-byte page")
            starts = _layer_outer_planes(tensor, spec, layout, num_blocks)
            placed.append({"group": group, "layers": tensor.layers})
        elif tensor.block_stride > tensor.layer_stride:  # block-outermost: the block is one byte range of the buffer
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
        plane_bytes.append(block_bytes // units if units else block_bytes)
        plane_groups.append(tuple(sorted(groups)))
    num_groups = len(config.kv_cache_groups)

    def spec_of(rule: GroupRule) -> object:
        group = config.kv_cache_groups[rule.group]
        if units:  # per head: what ranks of any TP agree on
            return [_one_head(layer_spec(group.kv_cache_spec, layer)) for layer in group.layer_names]
        return describe_spec(group.kv_cache_spec)
    description = json.dumps({
        "engine": dict(engine), "layout": layout.name, "num_groups": num_groups,
        **({"head_units": True} if units else {}),
        "groups": [{"group": r.group, "kind": r.kind.value, "layers": list(config.kv_cache_groups[r.group].layer_names),
                    "spec": spec_of(r)} for r in rules],
        "tensors": placed,
        "planes": [{"groups": sorted(groups), "holds": about} for _, (groups, about) in sorted(planes.items())],
    }, sort_keys=True)
    if units:  # [planes] of num_blocks * units head slots; at least two groups' ids (see the module's doc)
        num_groups = max(num_groups, 2)
        num_blocks *= units
    block_size = min(r.block_size for r in rules)
    cache = PlanarCacheConfig(block_size=block_size, plane_block_bytes=tuple(plane_bytes), description=description,
                              num_groups=num_groups, plane_groups=tuple(plane_groups) if num_groups > 1 else ())
    return PlanarPool(PlanarLayout(cache), views, num_blocks=num_blocks)
