"""common/parallel/launch.py: rank 0's share of the cores, a follower that dies before joining."""

from __future__ import annotations

import time

import pytest

from common.parallel.launch import LocalGroup
from common.parallel.placement import cpu_threads_per_rank


def test_rank_zero_shares_the_cores_while_in_the_group():
    import torch

    threads = torch.get_num_threads()
    with LocalGroup(2, timeout_s=60) as tp:
        assert tp.world_size == 2 and tp.is_leader
        assert torch.get_num_threads() == cpu_threads_per_rank(2)
    assert torch.get_num_threads() == threads


def test_a_thread_count_given_to_the_group_is_shared_by_its_ranks():
    import torch

    with LocalGroup(2, timeout_s=60, cpu_threads=2):
        assert torch.get_num_threads() == 1


def test_world_size_one_starts_nothing():
    with LocalGroup(1) as tp:
        assert tp.world_size == 1 and tp.is_leader


def test_a_follower_that_exits_before_joining_is_an_error_at_once():
    # rank 1 is given a CUDA device this machine lacks (or an index past its GPUs): it exits
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="flashsplit-tp-rank1 exited with code 1 before it "
                                           "joined"):
        with LocalGroup(2, "cpu,cuda:64", timeout_s=60):
            pass
    assert time.monotonic() - start < 30
