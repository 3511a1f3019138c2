"""common/parallel/group.py at world size 1 (the collectives of larger groups run in
test_tensor_parallel.py, across processes)."""

from __future__ import annotations

import pytest
import torch

from common.parallel.group import TensorParallelGroup, connect, leader_store, process_groups


def test_world_size_one_collectives_return_their_input():
    tp = TensorParallelGroup.single()
    x = torch.randn(3, 4)
    assert tp.all_reduce(x) is x
    assert tp.all_gather_last_dim(x) is x
    message = {"a": 1}
    assert tp.broadcast_object(message) is message
    assert tp.min_over_ranks((5, 7)) == (5, 7)
    assert connect(0, 1) == tp


def test_a_group_is_checked():
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        TensorParallelGroup(2, 2, object(), object())
    with pytest.raises(ValueError, match="needs its process groups"):
        TensorParallelGroup(0, 2)
    with pytest.raises(ValueError, match="needs the leader store's port"):
        connect(1, 2)


def test_a_group_of_one_with_process_groups_runs_its_collectives():
    """What one GPU uses to run NCCL through the layers (test_nccl_one_rank_gpu.py), on gloo."""
    tp = process_groups(leader_store(1), 0, 1, timeout_s=30)
    x = torch.randn(3, 4)
    gathered = tp.all_gather_last_dim(x)
    assert gathered is not x  # a collective ran: its output is a new tensor
    torch.testing.assert_close(gathered, x, rtol=0, atol=0)
    assert tp.all_reduce(x.clone()).equal(x) and tp.broadcast_from_leader(x.clone()).equal(x)
