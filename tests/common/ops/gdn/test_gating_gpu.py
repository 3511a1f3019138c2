"""Triton GDN gates (g, beta) against the reference, on the GPU.

Both outputs are fp32 from the same formulas with torch's own exp / log1p and an IEEE division,
so they agree to within 1e-5 relative (in practice to the last bit or two). The inputs cover
softplus's threshold (x > 20 returns x), very negative x (log1p keeps exp(x) there) and large |b|.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.gdn import reference as ref

pytestmark = pytest.mark.gpu


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.gdn import gating_triton

    return gating_triton


def _close(got, want, record, name):
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, name
    diff = (got - want).abs()
    record(f"{name}.max_rel", (diff / want.abs().clamp_min(1e-30)).max().item())
    record(f"{name}.unequal", (got != want).float().mean().item())
    # the absolute floor only covers results below fp32's normal range (flushed to zero here)
    assert bool((diff <= want.abs() * 1e-5 + 1e-30).all()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,hv", [(1, 32), (7, 48), (301, 64), (5, 33)])
def test_gating_matches_reference(record_metric, dtype, tokens, hv):
    """a and b are strided column slices of one [T, 2·HV] projection, as a fused b|a output is."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(tokens * hv)
    ba = (torch.randn(tokens, 2 * hv, generator=gen, device="cuda") * 8).to(dtype)
    b, a = ba[:, :hv], ba[:, hv:]
    A_log = torch.randn(hv, generator=gen, device="cuda")  # the model keeps A_log in fp32
    dt_bias = torch.randn(hv, generator=gen, device="cuda").to(dtype)
    before = ba.clone()
    g, beta = tr.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    g_ref, beta_ref = ref.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    _close(g, g_ref, record_metric, "g")
    _close(beta, beta_ref, record_metric, "beta")
    assert torch.equal(ba, before)
    assert bool((g <= 0).all())


def test_gating_at_softplus_threshold_and_extremes(record_metric):
    tr = _triton()
    x = torch.tensor([[-80.0, -40.0, -17.0, -5.0, -1e-3, 0.5, 5.0, 19.99, 20.0, 20.01, 30.0, 1e4]],
                     device="cuda")
    hv = x.shape[1]
    A_log = torch.linspace(-3, 3, hv, device="cuda")
    dt_bias = torch.full((hv,), 0.25, device="cuda")
    a = x - 0.25  # a + dt_bias lands on the listed values
    g, beta = tr.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=x)
    g_ref, beta_ref = ref.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=x)
    assert bool(torch.isfinite(g).all()) and bool(torch.isfinite(beta).all())
    _close(g, g_ref, record_metric, "g")
    _close(beta, beta_ref, record_metric, "beta")


def test_cpu_and_fp64_go_to_the_reference_and_bad_shapes_raise():
    tr = _triton()
    A_log, a, dt_bias, b = torch.randn(4), torch.randn(3, 4), torch.randn(4), torch.randn(3, 4)
    for got, want in zip(tr.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b),
                         ref.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)):
        assert torch.equal(got, want)
    g64, _ = tr.gdn_gating(A_log=A_log.double().cuda(), a=a.cuda(), dt_bias=dt_bias.cuda(), b=b.cuda())
    assert g64.dtype == torch.float64
    with pytest.raises(ValueError, match="a and b"):
        tr.gdn_gating(A_log=A_log.cuda(), a=a.cuda(), dt_bias=dt_bias.cuda(), b=b[:, :3].cuda())
    with pytest.raises(ValueError, match="A_log and dt_bias"):
        tr.gdn_gating(A_log=A_log[:3].cuda(), a=a.cuda(), dt_bias=dt_bias.cuda(), b=b.cuda())


def test_gating_replays_in_a_cuda_graph():
    """No host synchronisation: the op captures, and a replay sees new input values."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(8, 32, generator=gen, device="cuda").bfloat16()
    b = torch.randn(8, 32, generator=gen, device="cuda").bfloat16()
    A_log = torch.randn(32, generator=gen, device="cuda")
    dt_bias = torch.randn(32, generator=gen, device="cuda").bfloat16()
    tr.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g, beta = tr.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    a.copy_(torch.randn(8, 32, generator=gen, device="cuda"))
    b.copy_(torch.randn(8, 32, generator=gen, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    g_new, beta_new = tr.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    assert torch.equal(g, g_new) and torch.equal(beta, beta_new)
