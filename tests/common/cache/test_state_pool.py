"""GDNStatePool: fresh slots start from zero state, slots free once, sizes per slot."""

import pytest
import torch

from common.cache.allocator import OutOfResources
from common.cache.state_pool import GDNStatePool


def make_pool(num_slots=3):
    return GDNStatePool(layer_ids=(0, 1, 2), num_slots=num_slots, conv_dim=5, conv_window=3,
                        num_value_heads=2, key_head_dim=4, value_head_dim=6,
                        conv_dtype=torch.bfloat16)


def test_shapes_and_dtypes():
    pool = make_pool()
    assert pool.conv.shape == (3, 3, 5, 3) and pool.conv.dtype == torch.bfloat16
    assert pool.ssm.shape == (3, 3, 2, 6, 4) and pool.ssm.dtype == torch.float32


def test_a_reused_slot_starts_from_zero_state():
    pool = make_pool()
    slot = pool.allocate()
    pool.conv[:, slot].fill_(1.0)
    pool.ssm[:, slot].fill_(2.0)
    pool.free(slot)
    again = pool.allocate()
    assert again == slot  # most recently freed first
    assert not pool.conv[:, again].any() and not pool.ssm[:, again].any()


def test_allocate_leaves_other_slots_alone():
    pool = make_pool()
    a = pool.allocate()
    pool.ssm[:, a].fill_(3.0)
    pool.allocate()
    assert pool.ssm[:, a].eq(3.0).all()


def test_exhaustion_and_double_free():
    pool = make_pool(num_slots=2)
    slot = pool.allocate()
    assert slot == 1
    with pytest.raises(OutOfResources):
        pool.allocate()
    pool.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slot)


def test_bytes_per_slot_counts_every_layer_of_both_states():
    pool = make_pool()
    conv = 3 * 5 * 3 * 2      # layers x conv_dim x window x bf16
    ssm = 3 * 2 * 6 * 4 * 4   # layers x HV x V x K x fp32
    assert pool.bytes_per_slot() == conv + ssm


def test_layer_index_maps_model_layers_to_pool_rows():
    pool = GDNStatePool(layer_ids=(0, 2, 5), num_slots=2, conv_dim=1, conv_window=1,
                        num_value_heads=1, key_head_dim=1, value_head_dim=1,
                        conv_dtype=torch.float32)
    assert [pool.layer_index(i) for i in (0, 2, 5)] == [0, 1, 2]
    with pytest.raises(KeyError):
        pool.layer_index(1)


def test_reserve_verify_only_grows():
    pool = make_pool()
    first = pool.reserve_verify(rows=2, tokens=4)
    assert pool.reserve_verify(rows=1, tokens=2) is first
    grown = pool.reserve_verify(rows=3, tokens=2)
    assert grown is not first and (grown.rows, grown.tokens) == (3, 4)
