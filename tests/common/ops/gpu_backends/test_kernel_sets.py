"""Every named kernel set resolves into the model's Kernels (on any machine: the GPU backends'
factories are replaced by stubs, so nothing imports triton or flashinfer)."""

from __future__ import annotations

import pytest

from common.model.kernels import MODEL_OPS, Kernels
from common.ops.gpu_backends import BACKEND_SETS, backends_for
from common.ops.registry import GPU_OPS, default_registry


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
        if backend != "reference":
            assert fn is stubs[(op, backend)]


def test_a_misspelt_op_is_refused():
    with pytest.raises(ValueError, match="unknown ops"):
        Kernels.select(backends={"rms_nrom": "triton"})
