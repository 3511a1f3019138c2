import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP

import torch.nn.functional as F

from common.ops.mlp.reference import silu_and_mul, silu_glu_mlp


def test_matches_transformers():
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(hidden_size=24, intermediate_size=53)
    hf = Qwen3_5MLP(config, intermediate_size=53)
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        expected = hf(x)
    out = silu_glu_mlp(
        x=x, gate_proj=hf.gate_proj.weight.detach(), up_proj=hf.up_proj.weight.detach(),
        down_proj=hf.down_proj.weight.detach(),
    )
    assert out.dtype == x.dtype and out.shape == x.shape
    assert ((out - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_shape_mistakes_raise_value_error():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="down_proj"):
        silu_glu_mlp(x=x, gate_proj=torch.randn(5, 8), up_proj=torch.randn(5, 8), down_proj=torch.randn(8, 6))
    with pytest.raises(ValueError, match="gate_proj"):
        silu_glu_mlp(x=x, gate_proj=torch.randn(5, 7), up_proj=torch.randn(5, 7), down_proj=torch.randn(7, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_is_silu_of_the_gate_half_times_the_up_half(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 2 * 37 + 6, generator=gen) * 4).to(dtype)[:, 3:3 + 2 * 37]
    y = silu_and_mul(x=x)
    assert y.dtype == dtype and y.shape == (5, 37)
    assert torch.equal(y, F.silu(x[:, :37]) * x[:, 37:])
    # torch's roundings: silu in fp32 rounded to the dtype, then the product rounded
    g, u = x[:, :37].float(), x[:, 37:].float()
    assert torch.equal(y, (F.silu(g).to(dtype).float() * u).to(dtype))
    assert silu_and_mul(x=x.reshape(5, 1, -1)).shape == (5, 1, 37)


def test_silu_and_mul_of_a_fused_projection_matches_the_mlp():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 24, generator=gen)
    gate, up, down = (torch.randn(53, 24, generator=gen), torch.randn(53, 24, generator=gen),
                      torch.randn(24, 53, generator=gen))
    fused = F.linear(silu_and_mul(x=F.linear(x, torch.cat([gate, up]))), down)
    expected = silu_glu_mlp(x=x, gate_proj=gate, up_proj=up, down_proj=down)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_silu_and_mul_needs_an_even_last_dim():
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(x=torch.randn(3, 7))
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(x=torch.tensor(1.0))
