"""Every named kernel set resolves into the model's Kernels (on any machine: the GPU backends'
factories are replaced by stubs, so nothing imports triton or flashinfer; the CPU backends are
plain torch and resolve for real), and the CPU set is what ``auto`` means off CUDA."""

from __future__ import annotations

import importlib

import pytest

from common.model.kernels import MODEL_OPS, Kernels, select_kernels
from common.ops.gpu_backends import AUTO, BACKEND_SETS, backends_for, sets_for_device
from common.ops.graph_capabilities import graph_support
from common.ops.registry import CPU_BACKEND, CPU_OPS, GPU_OPS, default_registry


@pytest.mark.parametrize("name", sorted(BACKEND_SETS))
def test_every_kernel_set_resolves(name):
    registry = default_registry()
    stubs = {}
    for op, backends in GPU_OPS.items():
        for backend in backends:
            stubs[(op, backend)] = stub = (lambda op=op, backend=backend: (op, backend))
            registry.register(op, backend, lambda s=stub: s, replace=True)
    kernels = Kernels.select(backends=backends_for(name), registry=registry)
    chosen = dict(kernels.backends)
    for op in MODEL_OPS:
        backend = backends_for(name).get(op, "reference")
        assert chosen[op] == backend
        fn = getattr(kernels, op)
        if backend == CPU_BACKEND:
            assert fn is getattr(importlib.import_module(CPU_OPS[op]), op)
        elif backend != "reference":
            assert fn is stubs[(op, backend)]


def test_a_misspelt_op_is_refused():
    with pytest.raises(ValueError, match="unknown ops"):
        Kernels.select(backends={"rms_nrom": "triton"})


def test_auto_is_the_cpu_set_off_cuda_and_reference_stays_selectable():
    assert sets_for_device(AUTO, "cpu")[0] == "cpu" and sets_for_device(AUTO, "cuda:0")[0] == "gpu"
    assert sets_for_device("reference", "cpu")[0] == "reference"
    assert backends_for("cpu") == {op: CPU_BACKEND for op in CPU_OPS}
    assert all(backend == "reference" for _, backend in select_kernels("reference").backends)
    chosen = dict(select_kernels("cpu").backends)
    assert {op for op, backend in chosen.items() if backend == CPU_BACKEND} == set(CPU_OPS)


def test_the_cpu_backends_declare_what_reads_the_host():
    """The CPU kernels loop over slots or pad to lengths read on the host: no CUDA graph can
    replay a forward through them (the engine asks, and never names them)."""
    support = graph_support({op: CPU_BACKEND for op in CPU_OPS})
    assert support.max_tokens == 0 and support.graph_attention is None
    assert "gdn_decode_in_place=torch-cpu" in support.not_capturable
