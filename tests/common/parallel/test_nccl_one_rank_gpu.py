"""On one GPU: the tensor-parallel code path with NCCL doing the collectives, in a group of one
rank (``common.parallel.group.process_groups``). One rank's collectives leave every tensor as
it was, so the tokens must be those of the model without a group; what this checks is that
``ProcessGroupNCCL``'s collectives are captured inside the decode, overlap and DFLASH verify
graphs and replay from them, which several GPUs need and one GPU can show
(``test_tensor_parallel_gpu.py`` runs the groups of 2 and 4)."""

from __future__ import annotations

import pytest
import torch

from common.parallel.group import leader_store, process_groups
from tests.common.parallel.test_tensor_parallel_gpu import _graph_engine, _graph_tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_of_one():
    return process_groups(leader_store(1), 0, 1, device="cuda:0", timeout_s=120)


def test_an_nccl_collective_replays_from_a_captured_graph(nccl_of_one):
    tp = nccl_of_one
    x = torch.randn(5, 7, device="cuda:0")
    tp.all_gather_last_dim(x)  # the communicator is made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = tp.all_gather_last_dim(x)
    for _ in range(3):
        x.copy_(torch.randn(5, 7, device="cuda:0"))
        graph.replay()
        torch.cuda.synchronize()
        # the gather wrote its own output buffer from the new input: it ran in the replay
        torch.testing.assert_close(gathered, x, rtol=0, atol=0)


def test_captured_graphs_with_nccl_inside_give_the_tokens_without_a_group(nccl_of_one):
    want = [_graph_tokens(_graph_engine()), _graph_tokens(_graph_engine(draft="pycoder"))]
    engine = _graph_engine(nccl_of_one)
    assert engine.model.tp.device_group is not None
    assert engine.runner.graphs is not None and engine.overlap is not None
    drafted = _graph_engine(nccl_of_one, draft="pycoder")
    assert drafted.speculator.verify_graphs is not None
    got = [_graph_tokens(engine), _graph_tokens(drafted)]
    assert got == want
