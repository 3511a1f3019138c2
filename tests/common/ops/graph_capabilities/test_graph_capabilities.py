"""The graph capabilities backends declare, and what they add up to for a model's ops."""

from __future__ import annotations

import pytest
import torch

from common.model.kernels import MODEL_OPS
from common.ops.attention.planned import TorchPlannedAttention
from common.ops.gpu_backends import backends_for
from common.ops.graph_capabilities import (DEFAULT, GRAPH_CAPABILITIES, GraphCapability,
                                           capability, graph_support)
from common.ops.moe.capturable import MAX_TOKENS
from common.ops.registry import default_registry

CPU = torch.device("cpu")


def _chosen(kernel_set: str, *, moe: bool = True) -> dict[str, str]:
    overrides = backends_for(kernel_set)
    return {op: overrides.get(op, "reference") for op in MODEL_OPS
            if moe or op != "sparse_moe"}


def test_every_declaration_names_a_registered_backend():
    registry = default_registry()
    for op, backends in GRAPH_CAPABILITIES.items():
        for backend in backends:
            assert backend in registry.backends(op), (op, backend)


def test_undeclared_backends_are_capturable_without_a_limit():
    assert capability("rms_norm", "triton-pdl") is DEFAULT
    assert DEFAULT.capturable and DEFAULT.max_graph_tokens is None


def test_the_gpu_sets_capture_moe_up_to_its_dense_limit():
    for name in ("gpu", "gpu-fla", "gpu-no-pdl"):
        support = graph_support(_chosen(name))
        assert support.max_tokens == MAX_TOKENS and support.not_capturable == ()
        assert support.graph_attention is not None and support.attention_backend == "flashinfer"
    # a model without an MoE layer calls no sparse_moe: no limit
    assert graph_support(_chosen("gpu", moe=False)).max_tokens is None


def test_graph_attention_needs_a_dtype_and_head_size_its_kernels_have():
    chosen = _chosen("gpu")
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.float16, 256), (None, None)):
        assert graph_support(chosen, dtype, head_dim).graph_attention is not None
    # FlashInfer has no float32 kernels and none for 32-dim heads: its eager op falls back to
    # the reference, and graph forwards plan on the host (so they are not captured)
    for dtype, head_dim in ((torch.float32, 128), (torch.bfloat16, 32)):
        support = graph_support(chosen, dtype, head_dim)
        assert support.graph_attention is None and support.attention_backend == "flashinfer"


def test_graphs_stay_off_where_attention_cannot_be_captured(caplog):
    """The built-in tiny model is float32 with 32-dim heads: on a GPU its decode runs eagerly
    (with a warning) instead of failing to capture."""
    import dataclasses

    from common.engine.cuda_graph import CudaGraphConfig
    from common.engine.graph_policy import graphs_apply
    from common.engine.llm_engine import EngineConfig
    from common.model.load import load_model

    model = load_model("tiny")
    # the gpu set's names, without resolving (importing) its GPU libraries on this machine
    model.kernels = dataclasses.replace(model.kernels, backends=tuple(_chosen("gpu").items()))
    config = EngineConfig(device="cuda", cuda_graph=CudaGraphConfig(max_batch_size=4))
    assert not graphs_apply(model, config, model.graph_support().max_tokens)
    assert "no capturable planner" in caplog.text
    # uncaptured graph buffers (what the CPU tests run) still apply
    eager = EngineConfig(device="cuda", cuda_graph=CudaGraphConfig(max_batch_size=4,
                                                                   capture=False))
    assert graphs_apply(model, eager, model.graph_support().max_tokens)


def test_the_reference_set_is_not_capturable():
    support = graph_support(_chosen("reference"))
    assert support.max_tokens == 0 and support.not_capturable == ("sparse_moe=reference",)
    assert support.graph_attention is None
    # host-planned attention alone leaves the token limit alone: it is judged by its planner
    dense = graph_support(_chosen("reference", moe=False))
    assert dense.max_tokens is None and dense.not_capturable == ()


def test_the_triton_attention_set_plans_graphs_of_any_float_dtype():
    chosen = _chosen("gpu-triton-attention")
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.float32, 32), (None, None)):
        support = graph_support(chosen, dtype, head_dim)
        assert support.attention_backend == "triton"
        assert support.graph_attention == "common.ops.attention.triton_graph:graph_attention"
    assert graph_support(chosen, torch.float64, 128).graph_attention is None


def test_attention_plans_on_the_host_unless_capture_is_asked():
    from common.ops.attention.reference import paged_attention

    for name in ("reference", "gpu"):  # the gpu set's planner needs a CUDA device
        support = graph_support(_chosen(name))
        make = support.attention_plans(paged_attention, CPU, capture=False)
        plan = make(batch_size=4, q_len=2, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                    page_size=4, max_pages=9, dtype=torch.float32, scale=0.5)
        assert isinstance(plan, TorchPlannedAttention) and plan.fn is paged_attention
        assert (plan.q_len, plan.scale) == (2, 0.5)
    with pytest.raises(ValueError,
                       match=r"capturable attention backend \(flashinfer, triton\), not "
                                         r"'reference'"):
        graph_support(_chosen("reference")).attention_plans(paged_attention, CPU, capture=True)


def test_a_declaration_that_contradicts_itself_is_refused():
    with pytest.raises(ValueError, match="not capturable"):
        GraphCapability(capturable=False, max_graph_tokens=8)
    with pytest.raises(ValueError, match="at least 1"):
        GraphCapability(max_graph_tokens=0)
