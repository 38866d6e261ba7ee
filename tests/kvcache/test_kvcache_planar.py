"""A cache an outside engine owns, in planes (``kvcache.PlanarPool``, ``kvcache.EngineCache``) and the
transfer plan over several planes: settings refused by name, the engine's block ids lent and handed back
once, and a plan that moves exactly the blocks asked for in every plane, one region per plane for each
run of consecutive blocks."""

from __future__ import annotations

import json

import pytest
import torch

from kpool_pd.connector.shared.plan import PoolKind, RingRange, plan_transfer
from kpool_pd.connector.shared.regions import region_view
from kpool_pd.kvcache import CacheAllocation, EngineCache, PlanarCacheConfig, PlanarLayout, PlanarPool

BLOCK_SIZE = 16
NUM_BLOCKS = 12


def engine_layers(num_blocks: int, *, seed: int) -> list[torch.Tensor]:
    """Two layers as an engine keeps them: K and V apart, ``[2, num_blocks, block_size, heads, dim]``
    bf16, and one ``[num_blocks, block_size, 40]`` fp32 buffer (a third plane of another size)."""
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(2, num_blocks, BLOCK_SIZE, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
    return kv + [torch.randn(num_blocks, BLOCK_SIZE, 40, generator=g)]


def planes_of(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer's planes: uint8 ``[num_blocks * block_bytes]`` views, K and V apart."""
    planes = []
    for t in layers:
        per_plane = t.view(torch.uint8).view(-1)
        count = t.shape[0] if t.dim() == 5 else 1
        planes += list(per_plane.view(count, -1).unbind(0))
    return planes


def planar_pool(num_blocks: int, *, seed: int, description: dict | None = None) -> tuple[PlanarPool, list[torch.Tensor]]:
    layers = engine_layers(num_blocks, seed=seed)
    planes = planes_of(layers)
    config = PlanarCacheConfig(block_size=BLOCK_SIZE, plane_block_bytes=tuple(p.numel() // num_blocks for p in planes),
                               description=json.dumps(description or {"engine": "test"}))
    return PlanarPool(PlanarLayout(config), planes, num_blocks=num_blocks), layers


def block_of(layers: list[torch.Tensor], b: int) -> list[torch.Tensor]:
    """Every value of block ``b`` in every layer (K and V included)."""
    return [t[:, b] if t.dim() == 5 else t[b] for t in layers]


# settings --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, named", [
    ({"block_size": 0}, "block_size"),
    ({"plane_block_bytes": ()}, "plane_block_bytes"),
    ({"plane_block_bytes": (64, 0)}, "plane_block_bytes"),
    ({"description": "not json"}, "description"),
    ({"description": "[1, 2]"}, "description"),
])
def test_planar_config_refuses_bad_settings_by_name(kwargs, named):
    settings = {"block_size": 16, "plane_block_bytes": (64, 32), "description": "{}"} | kwargs
    with pytest.raises(ValueError, match=named):
        PlanarCacheConfig(**settings)


def test_layout_hash_covers_the_description_and_the_plane_sizes():
    def layout(description="{\"dtype\": \"bfloat16\"}", planes=(64, 32), block_size=16):
        return PlanarLayout(PlanarCacheConfig(block_size=block_size, plane_block_bytes=planes, description=description))
    same = layout().layout_hash
    assert layout().layout_hash == same
    assert layout(description="{\"dtype\": \"float16\"}").layout_hash != same
    assert layout(planes=(32, 64)).layout_hash != same
    assert layout(block_size=32).layout_hash != same
    assert layout().block_bytes == 96 and layout().ring_slots == 0


def test_blocks_for_tokens_rounds_up_and_refuses_a_negative_count():
    config = PlanarCacheConfig(block_size=16, plane_block_bytes=(8,), description="{}")
    assert [config.blocks_for_tokens(n) for n in (0, 1, 16, 17, 1000)] == [0, 1, 1, 2, 63]
    assert config.open_entry_start(37) == 37  # every position is in a block
    with pytest.raises(ValueError, match="num_tokens"):
        config.blocks_for_tokens(-1)


def test_pool_refuses_planes_that_do_not_match_the_layout():
    pool, _ = planar_pool(NUM_BLOCKS, seed=1)
    planes = list(pool.planes)
    with pytest.raises(ValueError, match="planes for a layout"):
        PlanarPool(pool.layout, planes[:-1], num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match="plane 0"):
        PlanarPool(pool.layout, [planes[0][:-1]] + planes[1:], num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match="plane 1"):
        PlanarPool(pool.layout, [planes[0], planes[1].view(torch.int16)] + planes[2:], num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match="num_blocks"):
        PlanarPool(pool.layout, planes, num_blocks=0)


def test_pool_planes_alias_the_engine_tensors():
    pool, layers = planar_pool(NUM_BLOCKS, seed=2)
    assert pool.num_rings == 0 and pool.rings.numel() == 0
    layers[0][1, 3].fill_(7.0)  # V of block 3 in layer 0: plane 1, block 3
    nbytes = pool.layout.block_planes[1]
    written = pool.block_plane(1)[3 * nbytes:4 * nbytes].view(torch.bfloat16)
    assert bool((written == 7.0).all())


# lending the engine's blocks ------------------------------------------------------------------
def test_lend_hands_the_blocks_back_once():
    pool, _ = planar_pool(NUM_BLOCKS, seed=3)
    cache = EngineCache(pool)
    released: list[str] = []
    allocation = cache.lend("req-1", [4, 5, 9], on_release=lambda: released.append("req-1"))
    assert isinstance(allocation, CacheAllocation)
    assert allocation.block_ids == (4, 5, 9) and allocation.ring_id is None and allocation.pool is pool
    assert cache.allocations_held == 1 and released == []
    allocation.release()
    allocation.release()  # idempotent
    assert released == ["req-1"] and allocation.released and cache.allocations_held == 0
    with cache.lend("req-2", [0], on_release=lambda: released.append("req-2")):
        assert cache.allocations_held == 1
    assert released == ["req-1", "req-2"] and cache.allocations_held == 0


@pytest.mark.parametrize("owner, ids, named", [
    ("", [1], "owner"),
    ("req", [NUM_BLOCKS], "block ids"),
    ("req", [-1], "block ids"),
    ("req", [2, 2], "block ids"),
])
def test_lend_refuses_bad_ids_and_lends_nothing(owner, ids, named):
    pool, _ = planar_pool(NUM_BLOCKS, seed=4)
    cache = EngineCache(pool)
    with pytest.raises(ValueError, match=named):
        cache.lend(owner, ids, on_release=lambda: None)
    assert cache.allocations_held == 0


def test_a_failing_release_callback_still_ends_the_allocation():
    pool, _ = planar_pool(NUM_BLOCKS, seed=5)
    cache = EngineCache(pool)

    def broken():
        raise RuntimeError("the engine's free failed")
    allocation = cache.lend("req", [1, 2], on_release=broken)
    allocation.release()  # logged, not raised: the blocks are the engine's
    assert allocation.released and cache.allocations_held == 0


def test_a_lent_allocation_cannot_grow():
    pool, _ = planar_pool(NUM_BLOCKS, seed=6)
    with EngineCache(pool).lend("req", [1], on_release=lambda: None) as allocation:
        with pytest.raises(ValueError, match="engine allocates"):
            allocation.extend(3)


# a plan over several planes -------------------------------------------------------------------
@pytest.mark.parametrize("src, dst", [
    ([0, 1, 2, 3], [5, 6, 7, 8]),  # one run
    ([2, 3, 7, 8, 9], [0, 1, 4, 5, 6]),  # two runs on both sides
    ([9, 3, 4], [1, 2, 3]),  # a run on the destination only: two
    ([11], [0]),
])
def test_plan_moves_every_plane_of_exactly_the_blocks_asked(src, dst):
    src_pool, src_layers = planar_pool(NUM_BLOCKS, seed=10)
    dst_pool, dst_layers = planar_pool(NUM_BLOCKS, seed=11)
    untouched = [t.clone() for t in dst_layers]
    plan = plan_transfer(src_pool.layout, src, dst, 0, 0, RingRange(0, 0),
                         src_num_blocks=NUM_BLOCKS, dst_num_blocks=NUM_BLOCKS)

    runs = sum(1 for i in range(len(src)) if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)
    planes = len(src_pool.layout.block_planes)
    assert len(plan.pairs) == runs * planes and plan.ring_empty
    assert all(pair.src.kind is PoolKind.BLOCKS for pair in plan.pairs)
    assert [pair.src.plane for pair in plan.pairs] == list(range(planes)) * runs

    for pair in plan.pairs:
        region_view(dst_pool, pair.dst).copy_(region_view(src_pool, pair.src))
    moved = dict(zip(dst, src))
    for b in range(NUM_BLOCKS):
        want = block_of(src_layers, moved[b]) if b in moved else block_of(untouched, b)
        assert all(torch.equal(got, expected) for got, expected in zip(block_of(dst_layers, b), want)), f"block {b}"
