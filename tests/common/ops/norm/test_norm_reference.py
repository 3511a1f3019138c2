import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextRMSNorm,
    Qwen3NextRMSNormGated,
)
from transformers.models.qwen3_next.modeling_qwen3_next import l2norm as hf_l2norm

from common.ops.norm.reference import add_rms_norm, gated_rms_norm, l2norm, rms_norm


def _max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(0)
    hf = Qwen3NextRMSNorm(37, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(37, generator=gen) * 0.2)
    x = (torch.randn(5, 3, 37, generator=gen) * 3).to(dtype)
    hf = hf.to(dtype)
    with torch.no_grad():
        expected = hf(x)
    out = rms_norm(x=x, weight=hf.weight.detach(), eps=1e-6)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert _max_rel(out, expected) < 1e-5
    else:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_rms_norm_plain_weight():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 19, generator=gen), torch.randn(19, generator=gen)
    out = rms_norm(x=x, weight=w, eps=1e-5, zero_centered=False)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x=x, weight=w[:5], eps=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(2)
    hf = Qwen3NextRMSNormGated(24, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(24, generator=gen))
    hf = hf.to(dtype)
    x = (torch.randn(7, 3, 24, generator=gen) * 2).to(dtype)
    gate = torch.randn(7, 3, 24, generator=gen).to(dtype)
    with torch.no_grad():
        expected = hf(x, gate)
    out = gated_rms_norm(x=x, gate=gate, weight=hf.weight.detach(), eps=1e-6)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert _max_rel(out, expected) < 1e-5
    else:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x=x, gate=gate[:1], weight=hf.weight.detach(), eps=1e-6)


def test_l2norm_matches_transformers():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 2, 13, generator=gen)
    assert _max_rel(l2norm(x=x), hf_l2norm(x)) < 1e-6
    out = l2norm(x=x.bfloat16(), eps=1e-3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), hf_l2norm(x.bfloat16().float(), eps=1e-3), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_add_rms_norm_is_add_then_rms_norm(dtype, zero_centered):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(7, 45, generator=gen) * 3).to(dtype)[:, 2:41]  # row-strided view
    residual = torch.randn(7, 39, generator=gen).to(dtype)
    w = (torch.randn(39, generator=gen) * 0.2).to(dtype)
    normed, summed = add_rms_norm(x=x, residual=residual, weight=w, eps=1e-6, zero_centered=zero_centered)
    assert summed.dtype == normed.dtype == dtype and summed.shape == normed.shape == (7, 39)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, rms_norm(x=x + residual, weight=w, eps=1e-6, zero_centered=zero_centered))
    # the sum is rounded to x.dtype before the norm, as in the unfused layer
    assert torch.equal(summed, (x.float() + residual.float()).to(dtype))
    assert summed.data_ptr() not in (x.data_ptr(), residual.data_ptr())


def test_add_rms_norm_rejects_a_mismatched_residual():
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm(x=x, residual=torch.randn(2, 8), weight=w, eps=1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm(x=x, residual=torch.randn(3, 8).bfloat16(), weight=w, eps=1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x=x, residual=x, weight=w[:5], eps=1e-6)
