"""FusedProjection: one GEMM over several Linears' weights, also after the Linears move."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common.model.layers import FusedProjection, Linear
from common.ops.registry import default_registry
from tests.common.compare import randn

SIZES = (37, 11, 5)  # odd row blocks, like the GDN input projection's qkv / z / b / a


def _projection(dtype: torch.dtype) -> tuple[list[Linear], FusedProjection]:
    gen = torch.Generator().manual_seed(0)
    linears = [Linear(29, n, dtype) for n in SIZES]
    for lin in linears:
        lin.weight.data.copy_(torch.randn(lin.weight.shape, generator=gen))
    return linears, FusedProjection(*linears)


def _check_outputs(linears, fused, kernels, x) -> None:
    outs = fused(x, kernels)
    assert [o.shape[-1] for o in outs] == list(SIZES)
    for lin, out in zip(linears, outs):
        torch.testing.assert_close(out, F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_weights_are_views_of_one_tensor_and_refuse_after_a_move():
    linears, fused = _projection(torch.float32)
    kernels = SimpleNamespace(linear=default_registry().get("linear", "reference"))
    x = randn(torch.Generator().manual_seed(1), 3, 29, dtype=torch.float32)
    assert fused.weight().data_ptr() == linears[0].weight.data_ptr()
    _check_outputs(linears, fused, kernels, x)
    # what Module.to() does to each Linear: new storage, apart from the fused tensor
    for lin in linears:
        lin.weight.data = lin.weight.data.clone() * 2
    _check_outputs(linears, fused, kernels, x)
    assert fused.weight().data_ptr() == linears[0].weight.data_ptr()


@pytest.mark.gpu
def test_a_moved_projection_refuses_before_its_pdl_gemv():
    """Moved to the GPU, the first call concatenates the weights and then runs the PDL GEMV,
    which reads its weight before waiting for the kernel before it: the concatenation must have
    finished by then (the projection synchronises after it)."""
    pytest.importorskip("triton", reason="triton is not installed")
    linears, fused = _projection(torch.bfloat16)
    for lin in linears:
        lin.to("cuda")
    kernels = SimpleNamespace(linear=default_registry().get("linear", "triton-pdl"))
    x = randn(torch.Generator("cuda").manual_seed(1), 1, 29, dtype=torch.bfloat16)
    outs = fused(x, kernels)
    for lin, out in zip(linears, outs):
        torch.testing.assert_close(out.float(), F.linear(x, lin.weight).float(),
                                   rtol=2e-2, atol=2e-2)
