import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb as qwen3_5_apply
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as next_apply

from common.ops.rope.reference import apply_rope, rope_inv_freq

HEAD_DIM, H, KVH = 40, 6, 2


def _configs(theta):
    common = dict(hidden_size=48, num_attention_heads=H, num_key_value_heads=KVH, head_dim=HEAD_DIM)
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25}
    return [
        (Qwen3_5TextRotaryEmbedding, qwen3_5_apply, Qwen3_5TextConfig(**common, rope_parameters=dict(rope))),
        (Qwen3NextRotaryEmbedding, next_apply, Qwen3NextConfig(**common, rope_parameters=dict(rope))),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", [0, 1])
def test_matches_transformers(family, dtype):
    theta = 1e7
    rotary_cls, hf_apply, config = _configs(theta)[family]
    rotary = rotary_cls(config)
    rotary_dim = int(HEAD_DIM * 0.25)
    inv_freq = rope_inv_freq(rotary_dim=rotary_dim, theta=theta)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (rotary_dim // 2,)
    torch.testing.assert_close(inv_freq, rotary.inv_freq, rtol=0, atol=0)

    gen = torch.Generator().manual_seed(family)
    t = 11
    q = torch.randn(t, H, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(t, KVH, HEAD_DIM, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 9, 10, 57, 58, 1000, 4095, 70001])
    cos, sin = rotary(q, positions[None])
    q_hf, k_hf = hf_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
    assert q_out.dtype == k_out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), rtol=0, atol=0)
    # Dims past rotary_dim are untouched.
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])


def test_caller_mistakes_raise_value_error():
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_inv_freq(rotary_dim=7, theta=1e4)
    inv = rope_inv_freq(rotary_dim=8, theta=1e4)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(q=q, k=k, positions=torch.arange(4), inv_freq=inv)
    with pytest.raises(ValueError, match="inv_freq"):
        apply_rope(q=q, k=k, positions=torch.arange(3), inv_freq=rope_inv_freq(rotary_dim=10, theta=1e4))
