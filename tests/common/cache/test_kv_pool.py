"""KVPool: page counts, per-layer views, token writes at flat slots, and the padded page table."""

import pytest
import torch

from common.cache.allocator import OutOfResources
from common.cache.kv_pool import KVPool, page_table


def make_pool(num_pages=6, page_size=4):
    return KVPool(layer_ids=(3, 7), num_pages=num_pages, page_size=page_size, num_kv_heads=2,
                  head_dim=3, dtype=torch.float32)


def test_pages_for_rounds_up():
    pool = make_pool(page_size=4)
    assert [pool.pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_page_size_must_be_positive():
    with pytest.raises(ValueError, match="page_size"):
        make_pool(page_size=0)


def test_write_lands_at_page_and_offset_of_the_named_layer_only():
    pool = make_pool(page_size=4)
    k = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3)
    v = -k
    loc = torch.tensor([2 * 4 + 1, 5 * 4 + 3])  # page 2 offset 1, page 5 offset 3
    pool.write(7, loc, k, v)
    keys, values = pool.layer_cache(7)
    assert torch.equal(keys[2, 1], k[0]) and torch.equal(keys[5, 3], k[1])
    assert torch.equal(values[2, 1], v[0]) and torch.equal(values[5, 3], v[1])
    assert keys.abs().sum() == k.abs().sum()  # nothing else written
    other_k, other_v = pool.layer_cache(3)
    assert not other_k.any() and not other_v.any()


def test_layer_kv_is_a_view_of_the_pool():
    pool = make_pool()
    pool.layer_kv(3)[1, 0, 0].fill_(5.0)
    assert pool.kv[0, 1, 0, 0].eq(5.0).all()


def test_unknown_layer_raises():
    with pytest.raises(KeyError):
        make_pool().layer_cache(4)


def test_allocator_covers_the_pages_but_scratch():
    pool = make_pool(num_pages=3)
    assert sorted(pool.allocator.allocate(2)) == [1, 2]
    with pytest.raises(OutOfResources):
        pool.allocator.allocate(1)


def test_page_table_pads_short_rows_with_scratch_page():
    table = page_table([[4, 5, 6], [2], []])
    assert table.dtype == torch.int32
    assert table.tolist() == [[4, 5, 6], [2, 0, 0], [0, 0, 0]]
    assert page_table([[], []]).tolist() == [[0], [0]]
