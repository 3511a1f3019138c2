"""Pool sizing arithmetic on made-up memory figures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.cache.sizing import (DEFAULT_NUM_PAGES, DEFAULT_NUM_SLOTS, MemoryFigures, PoolCosts,
                                 PoolRequest, fixed_pools, format_bytes, size_pools)

GIB = 1 << 30
MIB = 1 << 20
COSTS = PoolCosts(page_bytes=1 * MIB, slot_bytes=50 * MIB, page_tensor_bytes=MIB,
                  slot_tensor_bytes=48 * MIB)
H200 = MemoryFigures(device="cuda:0", total_bytes=140 * GIB, free_bytes=139 * GIB,
                     fixed_bytes=10 * GIB, reserve_bytes=1 * GIB)


def test_pages_take_what_the_budget_leaves_after_the_slots():
    sizing = size_pools(COSTS, H200, PoolRequest(mem_fraction=0.5, default_slots=65))
    room = 70 * GIB - 11 * GIB - 65 * 50 * MIB
    assert sizing.num_slots == 65
    assert sizing.num_pages == room // MIB
    assert sizing.budget_bytes == 70 * GIB
    assert sizing.over_budget_bytes == 0
    # within a page of the budget
    assert 0 <= 70 * GIB - (11 * GIB + sizing.pool_bytes) < COSTS.page_bytes


def test_two_workers_on_one_device_each_fit_their_half():
    """Each worker's fraction is of the device's total: two halves add up to the whole."""
    halves = [size_pools(COSTS, H200, PoolRequest(mem_fraction=0.45, default_slots=9))
              for _ in range(2)]
    used = sum(H200.fixed_bytes + H200.reserve_bytes + s.pool_bytes for s in halves)
    assert used <= 0.9 * H200.total_bytes


def test_explicit_pages_and_slots_win_over_the_budget():
    sizing = size_pools(COSTS, H200, PoolRequest(mem_fraction=0.5, num_pages=100, num_slots=5))
    assert (sizing.num_pages, sizing.num_slots) == (100, 5)
    only_slots = size_pools(COSTS, H200, PoolRequest(mem_fraction=0.5, num_slots=5))
    assert only_slots.num_slots == 5
    assert only_slots.num_pages == (70 * GIB - 11 * GIB - 5 * 50 * MIB) // MIB


def test_explicit_sizes_past_the_budget_are_reported_not_refused():
    sizing = size_pools(COSTS, H200, PoolRequest(mem_fraction=0.1, num_pages=10_000,
                                                 num_slots=9))
    assert sizing.num_pages == 10_000
    expected_peak = 11 * GIB + 10_000 * MIB + 9 * 50 * MIB
    assert sizing.over_budget_bytes == expected_peak - int(0.1 * 140 * GIB)


def test_a_budget_below_the_weights_is_an_error_naming_the_fraction_to_use():
    request = PoolRequest(mem_fraction=0.05, default_slots=65, min_pages=129)
    with pytest.raises(ValueError, match=r"Raise --mem-fraction to at least 0\.103") as e:
        size_pools(COSTS, H200, request)
    assert "65 GDN state slots" in str(e.value)
    # the fraction it names is enough
    enough = size_pools(COSTS, H200, replace(request, mem_fraction=0.103))
    assert enough.num_pages >= 129


def test_a_model_larger_than_the_device_says_so():
    big = MemoryFigures(device="cuda:0", total_bytes=80 * GIB, free_bytes=None,
                        fixed_bytes=90 * GIB)
    with pytest.raises(ValueError, match="too small for this model"):
        size_pools(COSTS, big, PoolRequest(mem_fraction=1.0))


def test_pools_that_would_not_fit_in_free_memory_are_refused():
    busy = MemoryFigures(device="cuda:0", total_bytes=140 * GIB, free_bytes=20 * GIB,
                         fixed_bytes=10 * GIB, reserve_bytes=GIB)
    with pytest.raises(ValueError, match="other processes use it"):
        size_pools(COSTS, busy, PoolRequest(mem_fraction=0.9))
    # what does fit is fine
    assert size_pools(COSTS, busy, PoolRequest(mem_fraction=0.2)).pool_bytes <= 20 * GIB


def test_a_copy_at_start_up_leaves_room_for_the_largest_pool_tensor():
    request = PoolRequest(mem_fraction=0.5, default_slots=65, copied_at_start=True)
    sizing = size_pools(COSTS, H200, request)
    assert sizing.copy_bytes == sizing.num_pages * MIB  # the KV pool is the largest tensor
    peak = H200.fixed_bytes + H200.reserve_bytes + sizing.pool_bytes + sizing.copy_bytes
    assert peak <= 70 * GIB < peak + COSTS.page_bytes + COSTS.page_tensor_bytes
    assert sizing.over_budget_bytes == 0


def test_a_copy_dominated_by_the_slot_tensors_is_bounded_too():
    costs = PoolCosts(page_bytes=MIB, slot_bytes=GIB, page_tensor_bytes=MIB,
                      slot_tensor_bytes=GIB)
    figures = MemoryFigures(device="cpu", total_bytes=100 * GIB, free_bytes=None,
                            fixed_bytes=GIB)
    sizing = size_pools(costs, figures, PoolRequest(mem_fraction=0.5, default_slots=20,
                                                   copied_at_start=True))
    # 50 GiB budget: 1 GiB fixed, 20 GiB of slots, their 20 GiB copy, 9 GiB of pages
    assert sizing.copy_bytes == 20 * GIB
    assert sizing.num_pages == 9 * 1024
    assert sizing.over_budget_bytes == 0


def test_without_a_fraction_the_sizes_are_fixed():
    sizing = fixed_pools(COSTS, PoolRequest())
    assert (sizing.num_pages, sizing.num_slots) == (DEFAULT_NUM_PAGES, DEFAULT_NUM_SLOTS)
    assert sizing.budget_bytes is None and sizing.over_budget_bytes == 0
    assert "fixed sizes" in sizing.describe()
    assert fixed_pools(COSTS, PoolRequest(num_pages=64)).num_pages == 64


def test_the_start_up_line_names_every_figure():
    line = size_pools(COSTS, H200, PoolRequest(mem_fraction=0.5, default_slots=65)).describe()
    for part in ("KV pages x 1.0 MiB", "65 GDN state slots x 50.0 MiB", "budget 70.00 GiB",
                 "--mem-fraction 0.5 of 140.00 GiB on cuda:0", "10.00 GiB held besides the pools",
                 "1.00 GiB set aside", "139.00 GiB free"):
        assert part in line, (part, line)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_fractions_outside_zero_to_one_are_refused(fraction):
    with pytest.raises(ValueError, match="--mem-fraction must be in"):
        PoolRequest(mem_fraction=fraction)


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 2048, 3 * MIB, 5 * GIB // 2)] == \
        ["512 B", "2.0 KiB", "3.0 MiB", "2.50 GiB"]
