"""IndexAllocator: scratch index 0, exhaustion, double free."""

import pytest

from common.cache.allocator import IndexAllocator, OutOfResources


def test_hands_out_every_index_but_scratch_once():
    alloc = IndexAllocator(5, name="pages")
    got = alloc.allocate(4)
    assert sorted(got) == [1, 2, 3, 4]
    assert alloc.num_free == 0 and alloc.num_usable == 4


def test_exhaustion_raises_out_of_resources_and_takes_nothing():
    alloc = IndexAllocator(4, name="pages")
    alloc.allocate(2)
    assert not alloc.can_allocate(2)
    with pytest.raises(OutOfResources, match="pages: asked for 2, 1 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert alloc.allocate(1) != [0]


def test_zero_and_negative_counts():
    alloc = IndexAllocator(3, name="slots")
    assert alloc.allocate(0) == []
    with pytest.raises(ValueError, match="negative"):
        alloc.allocate(-1)


def test_double_free_is_refused():
    alloc = IndexAllocator(4, name="slots")
    (i,) = alloc.allocate(1)
    alloc.free([i])
    with pytest.raises(ValueError, match=f"slots: index {i} is not allocated"):
        alloc.free([i])
    assert alloc.num_free == 3


def test_freeing_scratch_or_a_stranger_is_refused():
    alloc = IndexAllocator(4, name="slots")
    with pytest.raises(ValueError, match="index 0"):
        alloc.free([0])
    with pytest.raises(ValueError, match="index 9"):
        alloc.free([9])


def test_a_refused_free_frees_nothing():
    """One bad index in a list leaves the good ones allocated: no half-done free."""
    alloc = IndexAllocator(4, name="pages")
    good = alloc.allocate(2)
    with pytest.raises(ValueError):
        alloc.free(good + [3 if 3 not in good else 1])
    assert alloc.num_free == 1
    alloc.free(good)
    assert alloc.num_free == 3


def test_freed_indices_are_reused_most_recent_first():
    alloc = IndexAllocator(6, name="pages")
    a = alloc.allocate(3)
    alloc.free([a[1]])
    assert alloc.allocate(1) == [a[1]]


def test_a_freed_run_comes_back_in_its_order():
    # consecutive pages land as one host copy (common/handoff/paged_writes.py)
    alloc = IndexAllocator(10, name="pages")
    pages = alloc.allocate(4)
    assert pages == [1, 2, 3, 4]
    alloc.free(pages)
    assert alloc.allocate(4) == pages


def test_capacity_below_two_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        IndexAllocator(1, name="pages")

