"""What the connector tests' prefill engines write and how the decode side checks it: the bytes
``SeededFillEngine`` draws for each block and ring of a request (seeded by the request id), and the
layer-by-layer comparison of a request's state between two pools of possibly different block
sizes, orders and kernel pages."""

from __future__ import annotations

import hashlib

import torch

from kpool_pd.connector.shared.plan import ring_live_range
from kpool_pd.kvcache import BlockLayout, CacheConfig, CacheFamily, CachePool


def _as_bytes(view: torch.Tensor) -> torch.Tensor:
    """uint8 [..., bytes] of a (possibly permuted) typed view, so NaN patterns compare exactly."""
    return view.contiguous().view(torch.uint8)


def _rows(view: torch.Tensor, block_ids, count: int) -> torch.Tensor:
    """uint8 [count, row bytes]: rows 0..count-1 of a request, row g in ``block_ids[g // rows]`` at
    ``g % rows``, from a typed view [blocks, rows, ...] (any storage order: compared by bytes)."""
    rows = view.shape[1]
    g = torch.arange(count)
    table = torch.tensor(list(block_ids), dtype=torch.int64)
    picked = view[table[g // rows], g % rows] if count else view[:0, 0]
    return picked.contiguous().view(torch.uint8).reshape(count, -1)


def _page_rows(pool: CachePool, layer: int, num_tokens: int) -> list[tuple[str, torch.Tensor, int]]:
    """A layer's per-position views of a pool: (name, typed view [blocks, rows, ...], rows of the
    first ``num_tokens`` positions). MLA by token, kpool entries and scales by state, QSA keys by group."""
    config = pool.config
    mla = pool.mla(layer)
    views = [("mla", mla, num_tokens)]
    if config.family is CacheFamily.KPOOL:
        states = -(-num_tokens // config.kpool)
        q, scale = pool.indexer_q(layer), pool.indexer_scale(layer)
        views += [("indexer entries", q.reshape(q.shape[0], -1, q.shape[-1]), states),
                  ("indexer scales", scale.reshape(scale.shape[0], -1), states)]
    else:
        views += [("qsa keys", pool.qsa_keys(layer), -(-num_tokens // config.compress_ratio))]
    return views


def state_differences(dst: CachePool, dst_blocks, dst_ring: int, src: CachePool, src_blocks, src_ring: int,
                      ring_slots, num_tokens: int) -> list[str]:
    """Where a request's state in ``dst`` differs from ``src`` for positions [0, num_tokens), compared
    layer by layer through the pools' logical views by position (MLA rows, kpool entries and scales
    or QSA keys, ring rows of the live slots), so the two pools may differ in block size, order and
    kernel page."""
    bad = []
    slots = torch.tensor(list(ring_slots), dtype=torch.int64)
    for layer in range(dst.config.num_layers):
        for (name, got, count), (_, want, _) in zip(_page_rows(dst, layer, num_tokens), _page_rows(src, layer, num_tokens)):
            if not torch.equal(_rows(got, dst_blocks, count), _rows(want, src_blocks, count)):
                bad.append(f"layer {layer} {name} of {num_tokens} positions")
        if dst.config.family is CacheFamily.KPOOL:
            got, want = dst.tail_ring(layer)[dst_ring][:, slots], src.tail_ring(layer)[src_ring][:, slots]
        else:
            got, want = dst.qsa_ring(layer)[dst_ring][slots], src.qsa_ring(layer)[src_ring][slots]
        if not torch.equal(_as_bytes(got), _as_bytes(want)):
            bad.append(f"layer {layer} ring slots {slots.tolist()}")
    return bad


def live_slots(config: CacheConfig, prompt_len: int) -> list[int]:
    live = ring_live_range(config, prompt_len)
    return [(live.start_slot + i) % config.ring_slots for i in range(live.num_slots)]


def landed_differences(pool: CachePool, landed, request_id: str, prompt_len: int) -> tuple[list[str], int]:
    """Where a landed request's prompt blocks and its ring's live slots differ from what
    ``SeededFillEngine`` wrote for ``request_id`` (empty: byte for byte), and the bytes compared.
    Works on a pool of any device."""
    layout = pool.layout
    prompt_blocks = landed.block_ids[:landed.grant.num_blocks]
    differences = [f"{request_id} block {j}" for j, b in enumerate(prompt_blocks)
                   if not torch.equal(pool.blocks[b].cpu(), expected_block(layout, request_id, j))]
    ring = expected_ring(layout, request_id).view(layout.ring_slots, layout.ring_slot_bytes)
    got = pool.rings[landed.ring_id].cpu().view(layout.ring_slots, layout.ring_slot_bytes)
    slots = live_slots(layout.config, prompt_len)
    differences += [f"{request_id} ring slot {s}" for s in slots if not torch.equal(got[s], ring[s])]
    return differences, len(prompt_blocks) * layout.block_bytes + len(slots) * layout.ring_slot_bytes


def host_copy(pool: CachePool) -> CachePool:
    """A host copy of a pool's blocks and rings (a GPU pool compared on the host)."""
    copy = CachePool(pool.layout, num_blocks=pool.num_blocks, num_rings=pool.num_rings)
    copy.blocks.copy_(pool.blocks)
    copy.rings.copy_(pool.rings)
    return copy


def mirror_pool(layout: BlockLayout, request_id: str, num_blocks: int) -> CachePool:
    """What ``SeededFillEngine`` wrote for a request, as blocks 0..n-1 and ring 0 of a fresh pool."""
    pool = CachePool(layout, num_blocks=max(num_blocks, 1), num_rings=1)
    for j in range(num_blocks):
        pool.blocks[j] = expected_block(layout, request_id, j)
    pool.rings[0] = expected_ring(layout, request_id)
    return pool


def _seed(request_id: str, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{request_id}/{index}".encode()).digest()[:8], "little") >> 1


def expected_block(layout: BlockLayout, request_id: str, j: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(request_id, j))
    return torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8, generator=g)


def expected_ring(layout: BlockLayout, request_id: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(request_id, -1))
    return torch.randint(0, 256, (layout.ring_block_bytes,), dtype=torch.uint8, generator=g)
