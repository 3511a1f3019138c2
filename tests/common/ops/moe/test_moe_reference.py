import pytest
import torch
from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from common.ops.moe.reference import sparse_moe

HIDDEN, EXPERTS, TOP_K = 24, 9, 3
SIZES = dict(
    hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
    moe_intermediate_size=10, shared_expert_intermediate_size=14,
)


def _block(kind, norm_topk_prob):
    if kind == "next":
        config, block_cls = Qwen3NextConfig(**SIZES, norm_topk_prob=norm_topk_prob), Qwen3NextSparseMoeBlock
    else:
        config, block_cls = Qwen3_5MoeTextConfig(**SIZES), Qwen3_5MoeSparseMoeBlock
    config._experts_implementation = "eager"  # transformers' own per-expert loop
    block = block_cls(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


def _ours(block, x, norm_topk_prob, shared=True):
    extra = {}
    if shared:
        extra = dict(
            shared_gate_proj=block.shared_expert.gate_proj.weight, shared_up_proj=block.shared_expert.up_proj.weight,
            shared_down_proj=block.shared_expert.down_proj.weight, shared_expert_gate=block.shared_expert_gate.weight,
        )
    return sparse_moe(
        x=x, router_weight=block.gate.weight, experts_gate_up=block.experts.gate_up_proj,
        experts_down=block.experts.down_proj, top_k=TOP_K, norm_topk_prob=norm_topk_prob, **extra,
    )


@pytest.mark.parametrize("kind,norm_topk_prob", [("next", True), ("next", False), ("qwen3_5_moe", True)])
@torch.no_grad()
def test_matches_transformers(kind, norm_topk_prob):
    block = _block(kind, norm_topk_prob)
    x = torch.randn(2, 13, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = block(x).reshape(-1, HIDDEN)
    out = _ours(block, x.reshape(-1, HIDDEN), norm_topk_prob)
    assert out.dtype == x.dtype and out.shape == (26, HIDDEN)
    assert ((out - expected).abs().max() / expected.abs().max()).item() < 1e-5


@torch.no_grad()
def test_routed_only_and_bf16():
    block = _block("next", True)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(2))
    full = _ours(block, x, True)
    routed = _ours(block, x, True, shared=False)
    shared = torch.sigmoid(x @ block.shared_expert_gate.weight.T) * block.shared_expert(x)
    torch.testing.assert_close(full - routed, shared, rtol=1e-5, atol=1e-5)
    out = _ours(block.to(torch.bfloat16), x.bfloat16(), True)
    assert out.dtype == torch.bfloat16


def test_caller_mistakes_raise_value_error():
    block = _block("next", True)
    x = torch.randn(3, HIDDEN)
    with torch.no_grad(), pytest.raises(ValueError, match="shared"):
        sparse_moe(
            x=x, router_weight=block.gate.weight, experts_gate_up=block.experts.gate_up_proj,
            experts_down=block.experts.down_proj, top_k=TOP_K, norm_topk_prob=True,
            shared_gate_proj=block.shared_expert.gate_proj.weight,
        )
    with torch.no_grad(), pytest.raises(ValueError, match="top_k"):
        sparse_moe(
            x=x, router_weight=block.gate.weight, experts_gate_up=block.experts.gate_up_proj,
            experts_down=block.experts.down_proj, top_k=EXPERTS + 1, norm_topk_prob=True,
        )


def test_expert_offset_held_experts_sum_to_all():
    """Expert parallelism: each rank's call with its experts (routing over all of them) gives
    that rank's share; the shares sum to the call with every expert."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, HIDDEN, generator=gen)
    router = torch.randn(EXPERTS, HIDDEN, generator=gen)
    gate_up = torch.randn(EXPERTS, 20, HIDDEN, generator=gen) * 0.3
    down = torch.randn(EXPERTS, HIDDEN, 10, generator=gen) * 0.3
    args = dict(x=x, router_weight=router, top_k=TOP_K, norm_topk_prob=True)
    whole = sparse_moe(**args, experts_gate_up=gate_up, experts_down=down)
    shares = [sparse_moe(**args, experts_gate_up=gate_up[lo:hi], experts_down=down[lo:hi],
                         expert_offset=lo) for lo, hi in ((0, 3), (3, 6), (6, 9))]
    torch.testing.assert_close(sum(shares), whole, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="are not all among the router's 9"):
        sparse_moe(**args, experts_gate_up=gate_up[:3], experts_down=down[:3], expert_offset=7)
