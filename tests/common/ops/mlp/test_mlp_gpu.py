"""Triton silu_and_mul against the reference, on the GPU.

The kernel rounds where torch rounds (silu in fp32 rounded to the dtype, then the product) with
the same exp and IEEE division, so results are expected bit for bit; the tolerances are the norm
tests': fp32 within 1e-5 relative, bf16 within one bf16 ulp of the value.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.mlp import reference as ref
from tests.common.compare import assert_within_ulps, randn

pytestmark = pytest.mark.gpu


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.mlp import triton as mlp_triton

    return mlp_triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 301])
@pytest.mark.parametrize("inter", [9216, 1000, 9])
def test_silu_and_mul_matches_reference(record_metric, dtype, rows, inter):
    """x a row-strided view of a wider [T, 2I + pad] buffer, as a fused gate/up GEMM may leave it."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(rows * inter)
    x = (randn(gen, rows, 2 * inter + 24, dtype=dtype) * 4)[:, 8:8 + 2 * inter]
    before = x.clone()
    y = tr.silu_and_mul(x=x)
    assert y.shape == (rows, inter)
    assert_within_ulps(y, ref.silu_and_mul(x=x), record_metric, "y")
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_of_other_layouts(record_metric, dtype):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(3)
    cases = {
        "three_dims": randn(gen, 3, 5, 2 * 1000, dtype=dtype),
        "unmergeable_rows": randn(gen, 4, 6, 2 * 129, dtype=dtype)[:, ::2],
        "last_dim_strided": randn(gen, 2 * 129, 7, dtype=dtype).t(),
        "one_row": randn(gen, 2 * 64, dtype=dtype),
    }
    for name, x in cases.items():
        assert_within_ulps(tr.silu_and_mul(x=x), ref.silu_and_mul(x=x), record_metric, name)
    assert tr.silu_and_mul(x=cases["three_dims"][:0]).shape == (0, 5, 1000)


def test_silu_and_mul_fallbacks_and_errors():
    tr = _triton()
    x = torch.randn(3, 8)
    assert torch.equal(tr.silu_and_mul(x=x), ref.silu_and_mul(x=x))
    xd = x.double().cuda()
    assert torch.equal(tr.silu_and_mul(x=xd), ref.silu_and_mul(x=xd))
    with pytest.raises(ValueError, match="2I"):
        tr.silu_and_mul(x=torch.randn(3, 7, device="cuda"))


def test_silu_and_mul_replays_in_a_cuda_graph():
    """No host synchronisation: the op captures, and a replay sees the input changed in place."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(13)
    x = randn(gen, 4, 2 * 9216, dtype=torch.bfloat16)
    tr.silu_and_mul(x=x)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tr.silu_and_mul(x=x)
    x.copy_(randn(gen, 4, 2 * 9216, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, tr.silu_and_mul(x=x))
    assert_within_ulps(y, ref.silu_and_mul(x=x), lambda *a: None, "replay")
