"""Triton RMSNorm and gated RMSNorm against the reference, on the GPU.

The kernels round where the reference rounds, with torch's rsqrt / exp, so the only difference is
the order of the sum of squares (a last-bit difference of the fp32 norm). rms_norm rounds once:
fp32 within 1e-5 relative, bf16 within one bf16 ulp of the value; add_rms_norm's sum is one
rounding of an add (bit-exact) and its norm is checked as rms_norm's. gated_rms_norm rounds the
normalised value and the weight product before its last rounding, so a last-bit difference can
flip an intermediate rounding and show as up to ~3 ulps in a rare element: bf16 is checked as
within 4 ulps everywhere and within one ulp for all but 1e-4 of the elements.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.norm import reference as ref
from tests.common.compare import assert_within_ulps, randn

pytestmark = pytest.mark.gpu

EPS = 1e-6
SIZES = [(1, 64), (7, 129), (301, 2560), (7, 4096), (3, 10000)]  # 10000: the two-sweep path


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.norm import triton as norm_triton

    return norm_triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,h", SIZES)
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_matches_reference(record_metric, dtype, rows, h, zero_centered):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(rows * h)
    x = randn(gen, rows, h, dtype=dtype) * 3
    w = randn(gen, h, dtype=dtype)
    before = x.clone()
    y = tr.rms_norm(x=x, weight=w, eps=EPS, zero_centered=zero_centered)
    assert_within_ulps(y, ref.rms_norm(x=x, weight=w, eps=EPS, zero_centered=zero_centered), record_metric, "y")
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 301])
def test_rms_norm_of_strided_q_half(record_metric, dtype, tokens):
    """The attention q norm: x is the q half of each head of a [T, heads, 2 * head_dim] projection."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    qg = randn(gen, tokens, 16, 2 * 256, dtype=dtype)
    q = qg[..., :256]
    w = randn(gen, 256, dtype=dtype)
    y = tr.rms_norm(x=q, weight=w, eps=EPS)
    assert_within_ulps(y, ref.rms_norm(x=q, weight=w, eps=EPS), record_metric, "q")
    k = randn(gen, tokens, 4 * 256, dtype=dtype).view(tokens, 4, 256)  # the k norm's contiguous view
    assert_within_ulps(tr.rms_norm(x=k, weight=w, eps=EPS), ref.rms_norm(x=k, weight=w, eps=EPS), record_metric, "k")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_of_other_layouts(record_metric, dtype):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = randn(gen, 65, dtype=dtype)
    cases = {
        "three_unmergeable_dims": randn(gen, 4, 5, 6, 70, dtype=dtype)[:, :3, ::2, :65],
        "six_unmergeable_dims": randn(gen, 2, 3, 2, 3, 2, 3, 70, dtype=dtype)[:, :2, :, :2, :, :2, :65],
        "last_dim_strided": randn(gen, 65, 9, dtype=dtype).t(),
        "one_row": randn(gen, 65, dtype=dtype),
    }
    for name, x in cases.items():
        assert_within_ulps(tr.rms_norm(x=x, weight=w, eps=EPS), ref.rms_norm(x=x, weight=w, eps=EPS), record_metric, name)
    strided_w = randn(gen, 130, dtype=dtype)[::2]
    x = cases["three_unmergeable_dims"]
    assert_within_ulps(tr.rms_norm(x=x, weight=strided_w, eps=EPS, zero_centered=False),
           ref.rms_norm(x=x, weight=strided_w, eps=EPS, zero_centered=False), record_metric, "strided_w")
    assert tr.rms_norm(x=x[:0], weight=w, eps=EPS).shape == x[:0].shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,h", SIZES)
def test_gated_rms_norm_matches_reference(record_metric, dtype, rows, h):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(rows + h)
    x = randn(gen, rows, h, dtype=dtype)
    gate = randn(gen, rows, h, dtype=dtype) * 3
    w = randn(gen, h, dtype=dtype)
    before = (x.clone(), gate.clone())
    y = tr.gated_rms_norm(x=x, gate=gate, weight=w, eps=EPS)
    assert_within_ulps(y, ref.gated_rms_norm(x=x, gate=gate, weight=w, eps=EPS), record_metric, "y",
           ulps=4, beyond_one_ulp=1e-4)
    assert torch.equal(x, before[0]) and torch.equal(gate, before[1])


@pytest.mark.parametrize("tokens", [1, 7, 301])
def test_gated_rms_norm_as_the_gdn_layer_calls_it(record_metric, tokens):
    """[T·HV, dv] rows; the gate a strided view of a wider projection; fp32 weight (no product rounding)."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hv, dv = 32, 128
    x = randn(gen, tokens * hv, dv, dtype=torch.bfloat16)
    z = randn(gen, tokens, hv, 2 * dv, dtype=torch.bfloat16)[..., dv:].reshape(-1, hv, dv)
    x3 = x.view(tokens, hv, dv)
    for wdt in (torch.bfloat16, torch.float32):
        w = randn(gen, dv, dtype=wdt)
        y = tr.gated_rms_norm(x=x3, gate=z, weight=w, eps=EPS)
        assert_within_ulps(y, ref.gated_rms_norm(x=x3, gate=z, weight=w, eps=EPS), record_metric, f"w_{wdt}",
               ulps=4, beyond_one_ulp=1e-4)


def test_cpu_and_fp64_go_to_the_reference_and_bad_shapes_raise():
    tr = _triton()
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(tr.rms_norm(x=x, weight=w, eps=EPS), ref.rms_norm(x=x, weight=w, eps=EPS))
    xd, wd = x.double().cuda(), w.double().cuda()
    assert torch.equal(tr.rms_norm(x=xd, weight=wd, eps=EPS), ref.rms_norm(x=xd, weight=wd, eps=EPS))
    with pytest.raises(ValueError, match="weight must be"):
        tr.rms_norm(x=x.cuda(), weight=torch.randn(9, device="cuda"), eps=EPS)
    with pytest.raises(ValueError, match="gate must have"):
        tr.gated_rms_norm(x=x.cuda(), gate=torch.randn(3, 9, device="cuda"), weight=w.cuda(), eps=EPS)


def test_norms_replay_in_a_cuda_graph():
    """No host synchronisation: both ops capture, and a replay sees new input values."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = randn(gen, 4, 16, 512, dtype=torch.bfloat16)[..., :256]
    gate = randn(gen, 4, 16, 256, dtype=torch.bfloat16)
    w = randn(gen, 256, dtype=torch.bfloat16)
    tr.rms_norm(x=x, weight=w, eps=EPS)  # compile before capturing
    tr.gated_rms_norm(x=x, gate=gate, weight=w, eps=EPS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tr.rms_norm(x=x, weight=w, eps=EPS)
        yg = tr.gated_rms_norm(x=x, gate=gate, weight=w, eps=EPS)
    x.copy_(randn(gen, 4, 16, 256, dtype=torch.bfloat16))
    gate.copy_(randn(gen, 4, 16, 256, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, tr.rms_norm(x=x, weight=w, eps=EPS))
    assert torch.equal(yg, tr.gated_rms_norm(x=x, gate=gate, weight=w, eps=EPS))


ADD_SIZES = [(1, 64), (7, 129), (301, 2560), (3, 10000)]  # 10000: the two-sweep path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,h", ADD_SIZES)
@pytest.mark.parametrize("zero_centered", [True, False])
def test_add_rms_norm_matches_reference(record_metric, dtype, rows, h, zero_centered):
    """x a row-strided view (the residual stream sliced from a wider buffer); the sum is one
    rounding of an add, so it must be bit-exact; the norm within the rms_norm tolerance."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(rows * h + 1)
    x = (randn(gen, rows, h + 40, dtype=dtype) * 3)[:, 3:h + 3]
    residual = randn(gen, rows, h, dtype=dtype) * 2
    w = randn(gen, h, dtype=dtype)
    before = (x.clone(), residual.clone())
    normed, summed = tr.add_rms_norm(x=x, residual=residual, weight=w, eps=EPS, zero_centered=zero_centered)
    want_normed, want_summed = ref.add_rms_norm(x=x, residual=residual, weight=w, eps=EPS,
                                                zero_centered=zero_centered)
    assert summed.is_contiguous() and summed.dtype == dtype
    record_metric("summed.max_abs", (summed.float() - want_summed.float()).abs().max().item())
    assert torch.equal(summed, want_summed)
    assert_within_ulps(normed, want_normed, record_metric, "normed")
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


def test_add_rms_norm_fallbacks_and_errors():
    tr = _triton()
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    for got, want in zip(tr.add_rms_norm(x=x, residual=r, weight=w, eps=EPS),
                         ref.add_rms_norm(x=x, residual=r, weight=w, eps=EPS)):
        assert torch.equal(got, want)
    xd, rd, wd = x.double().cuda(), r.double().cuda(), w.double().cuda()
    for got, want in zip(tr.add_rms_norm(x=xd, residual=rd, weight=wd, eps=EPS),
                         ref.add_rms_norm(x=xd, residual=rd, weight=wd, eps=EPS)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="residual must match"):
        tr.add_rms_norm(x=x.cuda(), residual=r[:2].cuda(), weight=w.cuda(), eps=EPS)
    with pytest.raises(ValueError, match="residual must match"):
        tr.add_rms_norm(x=x.cuda(), residual=r.cuda().bfloat16(), weight=w.cuda(), eps=EPS)
    with pytest.raises(ValueError, match="weight must be"):
        tr.add_rms_norm(x=x.cuda(), residual=r.cuda(), weight=torch.randn(9, device="cuda"), eps=EPS)


def test_add_rms_norm_replays_in_a_cuda_graph():
    """No host synchronisation: the fused add + norm captures, and a replay sees new inputs."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(12)
    x = randn(gen, 7, 2600, dtype=torch.bfloat16)[:, :2560]
    residual = randn(gen, 7, 2560, dtype=torch.bfloat16)
    w = randn(gen, 2560, dtype=torch.bfloat16)
    tr.add_rms_norm(x=x, residual=residual, weight=w, eps=EPS)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = tr.add_rms_norm(x=x, residual=residual, weight=w, eps=EPS)
    x.copy_(randn(gen, 7, 2560, dtype=torch.bfloat16))
    residual.copy_(randn(gen, 7, 2560, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    want_normed, want_summed = tr.add_rms_norm(x=x, residual=residual, weight=w, eps=EPS)
    assert torch.equal(summed, want_summed) and torch.equal(normed, want_normed)
    assert torch.equal(summed, x + residual)
