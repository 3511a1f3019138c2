"""Triton small-M projection against the reference (cuBLAS), on the GPU.

Both accumulate in fp32 and round once; only the summation order differs, so fp32 results agree
to ~1e-6 relative and bf16 results to about one bf16 rounding of the output.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.linear import reference as ref
from tests.common.compare import randn, rel_rmse

pytestmark = pytest.mark.gpu


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.linear import triton as linear_triton

    return linear_triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("n,k", [(2560, 4096), (12352, 2560), (37, 1000), (301, 96)])
def test_linear_matches_reference(record_metric, dtype, rows, n, k):
    """x a row-strided column view of a wider output, as the model passes it; the kernel the
    routing picks, and the Triton kernel forced with the tile it would use."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(rows * n + k)
    x = randn(gen, rows, k + 40, dtype=dtype)[:, 24:24 + k]
    w = randn(gen, n, k, dtype=dtype) * k ** -0.5
    want = torch.nn.functional.linear(x.double(), w.double())
    # cuBLAS's own error against the fp64 product sets the bar; fp32 sums of k terms may be
    # off by ~sqrt(k) roundings
    base = rel_rmse(ref.linear(x=x, weight=w).double(), want)
    bound = max(2 * base, 4 * k ** 0.5 * 2.0 ** -24 if dtype == torch.float32 else 4e-3)
    for config in (None, tr.config_for(rows, n, k)):
        got = tr.linear(x=x, weight=w, config=config)
        assert got.shape == (rows, n) and got.dtype == dtype
        err = rel_rmse(got.double(), want)
        record_metric(f"rel_rmse_{dtype}_{'forced' if config else 'routed'}", err)
        assert err <= bound


def test_leading_dims_and_fallbacks():
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = randn(gen, 70, 48, dtype=torch.bfloat16)
    x = randn(gen, 2, 3, 48, dtype=torch.bfloat16)
    got = tr.linear(x=x, weight=w)
    assert got.shape == (2, 3, 70)
    torch.testing.assert_close(got, ref.linear(x=x, weight=w), rtol=2e-2, atol=2e-2)
    big = randn(gen, tr.MAX_ROWS + 1, 48, dtype=torch.bfloat16)  # cuBLAS's size
    assert torch.equal(tr.linear(x=big, weight=w), ref.linear(x=big, weight=w))
    with pytest.raises(ValueError, match="agree on K"):
        tr.linear(x=x, weight=w[:, :40])


def test_replays_in_a_cuda_graph():
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(4)
    w = randn(gen, 999, 640, dtype=torch.bfloat16)
    x = randn(gen, 1, 640, dtype=torch.bfloat16)
    tr.linear(x=x, weight=w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tr.linear(x=x, weight=w)
    x.copy_(randn(gen, 1, 640, dtype=torch.bfloat16))
    graph.replay()
    assert torch.equal(y, tr.linear(x=x, weight=w))

