"""A request's page list goes to the followers once per state slot; later steps carry counts."""

from __future__ import annotations

import pickle

import pytest

from common.parallel.page_tables import FollowerTables, LeaderTables


def test_a_list_is_sent_once_and_a_new_request_in_the_slot_sends_its_own():
    leader, follower = LeaderTables(), FollowerTables()
    a, b = [7, 8, 9, 10], [3, 4]
    first = leader.rows([2, 5], [a, b], [a[:1], b[:2]])
    assert first.tables == {2: a, 5: b}
    assert follower.pages(first) == [[7], [3, 4]]
    later = leader.rows([2, 5], [a, b], [a[:3], b[:2]])
    assert later.tables == {} and later.counts == [3, 2]
    assert follower.pages(later) == [[7, 8, 9], [3, 4]]
    c = [7, 8, 9, 10]  # equal pages, another request: its own list object
    again = leader.rows([2], [c], [c[:2]])
    assert again.tables == {2: c}
    assert follower.pages(again) == [[7, 8]]


def test_counts_are_far_smaller_than_the_pages_they_stand_for():
    leader = LeaderTables()
    tables = [list(range(i * 4096, i * 4096 + 2048)) for i in range(64)]
    slots = list(range(64))
    full = len(pickle.dumps(leader.rows(slots, tables, tables)))
    step = len(pickle.dumps(leader.rows(slots, tables, tables)))
    assert step * 50 < full


def test_pages_that_are_not_the_lists_first_pages_are_refused():
    with pytest.raises(ValueError, match="not the first pages"):
        LeaderTables().rows([1], [[5, 6, 7]], [[6, 7]])


def test_a_slot_never_sent_is_an_error_on_the_follower():
    rows = LeaderTables().rows([1], [[5]], [[5]])
    with pytest.raises(RuntimeError, match="slot 3"):
        FollowerTables().pages(type(rows)([3], [1], {}))
