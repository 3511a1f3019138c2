"""common/parallel/launch.py: devices per rank, a follower that dies before joining."""

from __future__ import annotations

import time

import pytest

from common.parallel.launch import LocalGroup, cpu_threads_per_rank, rank_devices


def test_devices_per_rank():
    assert rank_devices("cpu", 3) == ["cpu"] * 3
    assert rank_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert rank_devices("cuda:2", 2) == ["cuda:2", "cuda:3"]
    assert rank_devices("cuda:1,cuda:0", 2) == ["cuda:1", "cuda:0"]
    with pytest.raises(ValueError, match="3 devices given for 2 ranks"):
        rank_devices("cuda:0,cuda:1,cuda:2", 2)
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        rank_devices("mps", 2)


def test_rank_zero_shares_the_cores_while_in_the_group():
    import torch

    threads = torch.get_num_threads()
    with LocalGroup(2, timeout_s=60) as tp:
        assert tp.world_size == 2 and tp.is_leader
        assert torch.get_num_threads() == cpu_threads_per_rank(2)
    assert torch.get_num_threads() == threads


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
