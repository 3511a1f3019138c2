"""common/parallel/group.py at world size 1 (the collectives of larger groups run in
test_tensor_parallel.py, across processes)."""

from __future__ import annotations

import pytest
import torch

from common.parallel.group import TensorParallelGroup, connect


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
