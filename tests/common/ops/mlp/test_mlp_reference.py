import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP

from common.ops.mlp.reference import silu_glu_mlp


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
