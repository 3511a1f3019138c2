"""CacheManager: the room a request is given, taken whole or not at all, and given back."""

import pytest
import torch

from common.cache.allocator import OutOfResources
from common.cache.cache_manager import CacheManager, RequestTooLarge, RoomPolicy
from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool


def make(policy=RoomPolicy(), num_pages=9, num_slots=3):
    kv = KVPool(layer_ids=(1,), num_pages=num_pages, page_size=4, num_kv_heads=1, head_dim=2,
                dtype=torch.float32)
    state = GDNStatePool(layer_ids=(0,), num_slots=num_slots, conv_dim=2, conv_window=3,
                         num_value_heads=1, key_head_dim=2, value_head_dim=2,
                         conv_dtype=torch.float32)
    return CacheManager(kv, state, policy), kv, state


def free_counts(kv, state):
    return kv.allocator.num_free, state.allocator.num_free


def test_room_covers_the_prompt_and_its_output_or_the_prompt_alone():
    cache, _, _ = make()
    assert cache.pages_for(9, 3) == 3  # 12 tokens, pages of 4
    assert make(RoomPolicy(lookahead_tokens=4))[0].pages_for(9, 3) == 4
    assert make(RoomPolicy(reserve_output_tokens=False))[0].pages_for(9, 300) == 3
    with pytest.raises(RequestTooLarge, match="needs 9 KV pages; the pool has 8"):
        cache.pages_for(30, 5)


def test_room_is_taken_whole_and_given_back():
    cache, kv, state = make()
    before = free_counts(kv, state)
    room = cache.take(3, zero_state=True)
    assert len(room.page_ids) == 3 and free_counts(kv, state) == (before[0] - 3, before[1] - 1)
    cache.give_back(room.page_ids, room.slot)
    assert free_counts(kv, state) == before


def test_a_short_slot_takes_no_pages():
    cache, kv, state = make(num_slots=2)  # one usable slot besides the scratch one
    rooms = []
    while cache.can_take(1):
        rooms.append(cache.take(1, zero_state=True))
    before = free_counts(kv, state)
    assert before[0] > 0 and before[1] == 0
    with pytest.raises(OutOfResources):
        cache.take(1, zero_state=True)
    assert free_counts(kv, state) == before


def test_a_handoffs_slot_is_not_zeroed_a_local_prompts_is():
    cache, _, state = make()
    room = cache.take(1, zero_state=False)
    state.ssm[:, room.slot].fill_(3.0)
    cache.give_back(room.page_ids, room.slot)
    again = cache.take(1, zero_state=False)
    assert again.slot == room.slot and state.ssm[:, again.slot].eq(3.0).all()
    cache.give_back(again.page_ids, again.slot)
    local = cache.take(1, zero_state=True)
    assert local.slot == room.slot and not state.ssm[:, local.slot].any()
