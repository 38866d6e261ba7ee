"""Block and ring allocators: exact accounting under random sequences, misuse detected."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kpool_pd.kvcache import BlockAllocator, RingAllocator


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=60))
def test_random_alloc_free_keeps_exact_counts(num_blocks, ops):
    allocator = BlockAllocator(num_blocks)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n > allocator.num_free:
                with pytest.raises(ValueError, match=f"cannot allocate {n} blocks"):
                    allocator.allocate(n)
                continue
            ids = allocator.allocate(n)
            assert ids == sorted(ids) and len(set(ids)) == n
            held.append(ids)
        elif held:
            allocator.free(held.pop(n % len(held)))
        in_use = [b for ids in held for b in ids]
        assert len(in_use) == len(set(in_use))
        assert allocator.num_free == num_blocks - len(in_use)
    for ids in held:
        allocator.free(ids)
    assert allocator.num_free == num_blocks


def test_lowest_ids_first_gives_contiguous_runs():
    allocator = BlockAllocator(8)
    assert allocator.allocate(3) == [0, 1, 2]
    allocator.free([1])
    assert allocator.allocate(2) == [1, 3]


def test_double_free_and_foreign_ids_are_refused_and_change_nothing():
    allocator = BlockAllocator(4)
    ids = allocator.allocate(2)
    allocator.free([ids[0]])
    with pytest.raises(ValueError, match=f"double free of block {ids[0]}"):
        allocator.free([ids[1], ids[0]])
    assert allocator.num_free == 3  # ids[1] was not freed by the failed call
    with pytest.raises(ValueError, match="block id 4 is not from this allocator"):
        allocator.free([4])
    with pytest.raises(ValueError, match="block id -1"):
        allocator.free([-1])
    with pytest.raises(ValueError, match="double free of block 1"):
        allocator.free([1, 1])
    allocator.free([1])
    assert allocator.num_free == 4


def test_ring_allocator_one_ring_per_request():
    rings = RingAllocator(2)
    a = rings.allocate("a")
    assert rings.ring_of("a") == a
    with pytest.raises(ValueError, match="request 'a' already holds ring"):
        rings.allocate("a")
    rings.allocate("b")
    with pytest.raises(ValueError, match="all 2 rings in use"):
        rings.allocate("c")
    rings.free("a")
    with pytest.raises(ValueError, match="request 'a' holds no ring"):
        rings.free("a")
    with pytest.raises(ValueError, match="'zzz' holds no ring"):
        rings.free("zzz")
    rings.free("b")
    assert rings.num_free == 2


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="positive integer"):
        BlockAllocator(bad)
