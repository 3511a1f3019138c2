"""Whether an engine replays its steps from CUDA graphs: under tensor parallelism, captured
graphs (NCCL inside them) only when asked for; their uncaptured variant always."""

from __future__ import annotations

import logging

from common.engine.cuda_graph import CudaGraphConfig
from common.engine.graph_policy import graphs_apply
from common.engine.llm_engine import EngineConfig
from common.model.load import load_model
from common.parallel.group import TensorParallelGroup
from tests.common.parallel.stand_in_group import NoOtherRank


def sharded_tiny():
    from common.model.family_registry import model_class_for
    from common.model.builtin import tiny_config

    pg = NoOtherRank()
    return model_class_for(tiny_config())(tiny_config(), tp=TensorParallelGroup(0, 2, pg, pg))


def test_captured_graphs_of_a_sharded_model_need_the_flag(caplog):
    model = sharded_tiny()
    on_gpu = EngineConfig(device="cuda")  # nothing here touches the device
    with caplog.at_level(logging.WARNING, logger="common.engine.graph_policy"):
        assert not graphs_apply(model, on_gpu, None)
    assert "--tp-cuda-graphs" in caplog.text
    caplog.clear()
    asked = EngineConfig(device="cuda", cuda_graph=CudaGraphConfig(tensor_parallel=True))
    with caplog.at_level(logging.WARNING, logger="common.engine.graph_policy"):
        graphs_apply(model, asked, None)  # on to the kernels' own limits
    assert "--tp-cuda-graphs" not in caplog.text


def test_the_uncaptured_variant_of_a_sharded_model_needs_no_flag():
    eager = EngineConfig(device="cpu", cuda_graph=CudaGraphConfig(capture=False))
    assert graphs_apply(sharded_tiny(), eager, None)
    assert graphs_apply(load_model("tiny"), eager, None)
