"""NodeCache: the one owner of a node's blocks and rings, and the handles it hands out."""

from __future__ import annotations

import gc
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kpool_pd.kvcache import CacheConfig, CacheExhaustedError, NodeCache


def _cache(num_blocks: int = 8, num_rings: int = 2) -> NodeCache:
    return NodeCache(CacheConfig(block_size=256), num_blocks=num_blocks, num_rings=num_rings)


def test_an_allocation_takes_blocks_and_a_ring_and_release_gives_them_back_once():
    cache = _cache()
    with cache.allocate("r1", 3) as allocation:
        assert allocation.block_ids == (0, 1, 2) and allocation.ring_id == 0
        assert (cache.free_blocks, cache.free_rings, cache.allocations_held) == (5, 1, 1)
        allocation.release()
        allocation.release()  # idempotent: a second path out of the request changes nothing
        assert (cache.free_blocks, cache.free_rings, cache.allocations_held) == (8, 2, 0)
    assert allocation.released


def test_the_views_of_an_allocation_address_the_pool_of_its_cache():
    cache = _cache()
    with cache.allocate("r1", 2) as allocation:
        cache.pool.blocks[list(allocation.block_ids)] = 7
        cache.pool.rings[allocation.ring_id] = 9
        assert int(cache.pool.blocks[allocation.block_ids[1]].min()) == 7
        assert int(cache.pool.blocks[2:].max()) == 0 and int(cache.pool.rings[1].max()) == 0


def test_a_short_cache_refuses_with_nothing_taken_and_names_what_is_free():
    cache = _cache(num_blocks=4, num_rings=1)
    held = cache.allocate("r1", 1)
    with pytest.raises(CacheExhaustedError, match=r"r2 needs 4 blocks and a ring; free: 3 of 4 blocks, 0 of 1 rings"):
        cache.allocate("r2", 4)
    with pytest.raises(CacheExhaustedError, match="r2 needs 1 blocks and a ring"):
        cache.allocate("r2", 1)  # blocks free, no ring
    assert (cache.free_blocks, cache.free_rings, cache.allocations_held) == (3, 0, 1)
    assert not cache.fits(1) and cache.fits(3, ring=False)
    ringless = cache.allocate("r2", 3, ring=False)
    assert ringless.ring_id is None
    ringless.release()
    held.release()
    assert (cache.free_blocks, cache.free_rings) == (4, 1)


@pytest.mark.parametrize(("owner", "count", "message"), [
    ("", 1, "owner must be a non-empty string"),
    ("r", -1, "block count must be an integer >= 0, got -1"),
    ("r", 1.0, "block count must be an integer >= 0, got 1.0"),
])
def test_bad_arguments_are_refused_naming_the_value(owner, count, message):
    cache = _cache()
    with pytest.raises(ValueError, match=message):
        cache.allocate(owner, count)
    assert cache.free_blocks == 8 and cache.allocations_held == 0


def test_the_owner_is_a_label_two_allocations_of_one_owner_are_two_handles():
    cache = _cache()
    first, second = cache.allocate("r1", 1), cache.allocate("r1", 1)
    assert first.ring_id != second.ring_id and first.key != second.key
    first.release()
    assert (cache.free_blocks, cache.free_rings) == (7, 1) and not second.released
    second.release()
    assert (cache.free_blocks, cache.free_rings, cache.allocations_held) == (8, 2, 0)


def test_an_allocation_grows_and_a_released_one_cannot():
    cache = _cache(num_blocks=4)
    allocation = cache.allocate("r1", 1)
    other = cache.allocate("r2", 1)
    assert allocation.extend(2) == (2, 3)
    assert allocation.block_ids == (0, 2, 3)
    with pytest.raises(CacheExhaustedError, match="r1 needs 1 more blocks; free: 0 of 4"):
        allocation.extend(1)
    allocation.release()
    assert cache.free_blocks == 3
    with pytest.raises(ValueError, match="was released"):
        allocation.extend(1)
    other.release()
    assert cache.free_blocks == 4


def test_a_handle_collected_while_held_reports_the_leak(caplog):
    cache = _cache()
    allocation = cache.allocate("leaky", 2)
    with caplog.at_level(logging.ERROR, logger="kpool_pd.kvcache.node_cache"):
        del allocation
        gc.collect()
    assert "'leaky' was never released: 2 blocks and a ring leak" in caplog.text
    released = cache.allocate("tidy", 1)
    released.release()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kpool_pd.kvcache.node_cache"):
        del released
        gc.collect()
    assert caplog.text == ""


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.booleans()), max_size=40))
def test_random_allocations_keep_exact_counts(ops):
    cache = _cache(num_blocks=12, num_rings=3)
    held = []
    for n, (allocate, count, ring) in enumerate(ops):
        if allocate:
            if cache.fits(count, ring=ring):
                held.append(cache.allocate(f"r{n}", count, ring=ring))
            else:
                with pytest.raises(CacheExhaustedError):
                    cache.allocate(f"r{n}", count, ring=ring)
        elif held:
            held.pop(count % len(held)).release()
        blocks = [b for a in held for b in a.block_ids]
        assert len(blocks) == len(set(blocks))
        assert cache.free_blocks == 12 - len(blocks)
        assert cache.free_rings == 3 - sum(a.ring_id is not None for a in held)
        assert cache.allocations_held == len(held)
    for allocation in held:
        allocation.release()
    assert (cache.free_blocks, cache.free_rings, cache.allocations_held) == (12, 3, 0)
