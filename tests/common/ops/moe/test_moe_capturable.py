"""The capturable MoE op against the reference, and without host reads (CPU)."""

from __future__ import annotations

import pytest
import torch

from common.ops.moe import capturable, reference
from tests.common.host_reads import HostReadWatch

HIDDEN, INTER, SHARED_I = 24, 10, 14


def make(num_experts: int, tokens: int, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.3).to(dtype)

    return dict(x=rand(tokens, HIDDEN), router_weight=rand(num_experts, HIDDEN),
                experts_gate_up=rand(num_experts, 2 * INTER, HIDDEN),
                experts_down=rand(num_experts, HIDDEN, INTER),
                shared_gate_proj=rand(SHARED_I, HIDDEN), shared_up_proj=rand(SHARED_I, HIDDEN),
                shared_down_proj=rand(HIDDEN, SHARED_I), shared_expert_gate=rand(1, HIDDEN))


@pytest.mark.parametrize("tokens,experts,top_k", [
    (1, 30, 3),     # gathered: 3 * 1 * 3 <= 30
    (3, 30, 3),     # gathered at the boundary: 27 <= 30
    (4, 30, 3),     # dense
    (64, 9, 3),     # dense at MAX_TOKENS
    (65, 9, 3),     # past MAX_TOKENS: the reference
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_capturable_matches_reference(tokens, experts, top_k, dtype):
    args = make(experts, tokens, dtype, seed=tokens)
    for norm in (True, False):
        got = capturable.sparse_moe(**args, top_k=top_k, norm_topk_prob=norm)
        want = reference.sparse_moe(**args, top_k=top_k, norm_topk_prob=norm)
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, want, **tol)


def test_bf16_within_one_rounding_of_reference():
    args = make(30, 5, torch.bfloat16, seed=3)
    got = capturable.sparse_moe(**args, top_k=3, norm_topk_prob=True)
    want = reference.sparse_moe(**args, top_k=3, norm_topk_prob=True)
    # the fp32 sum over experts runs in another order: at most the last bf16 bit differs
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.parametrize("tokens,experts", [(1, 30), (8, 30)])
def test_no_host_read_up_to_max_tokens(tokens, experts):
    args = make(experts, tokens, torch.float32)
    with HostReadWatch() as watch:
        capturable.sparse_moe(**args, top_k=3, norm_topk_prob=True)
    assert watch.seen == []
    with HostReadWatch() as watch:  # the check does catch the reference's grouping
        reference.sparse_moe(**args, top_k=3, norm_topk_prob=True)
    assert watch.seen


def test_caller_mistakes_raise_value_error():
    args = make(9, 2, torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        capturable.sparse_moe(**args, top_k=10, norm_topk_prob=True)
    with pytest.raises(ValueError, match="shared"):
        capturable.sparse_moe(**dict(args, shared_expert_gate=None), top_k=2, norm_topk_prob=True)


@pytest.mark.parametrize("tokens", [1, 3, 20, 65])  # gathered, gathered, dense, the reference
def test_an_expert_offset_gives_the_references_share(tokens):
    """Expert parallelism: a rank holding experts lo..hi-1 of the router's 30 gets the
    reference's share, and the shares of three ranks sum to the whole block's routed part."""
    args = make(30, tokens, torch.float64, seed=40 + tokens)
    args.update(shared_gate_proj=None, shared_up_proj=None, shared_down_proj=None,
                shared_expert_gate=None)
    gate_up, down = args.pop("experts_gate_up"), args.pop("experts_down")
    shares = []
    for lo, hi in ((0, 10), (10, 20), (20, 30)):
        part = dict(args, experts_gate_up=gate_up[lo:hi], experts_down=down[lo:hi],
                    expert_offset=lo, top_k=3, norm_topk_prob=True)
        got = capturable.sparse_moe(**part)
        torch.testing.assert_close(got, reference.sparse_moe(**part), rtol=1e-12, atol=1e-12)
        shares.append(got)
    whole = reference.sparse_moe(**args, experts_gate_up=gate_up, experts_down=down, top_k=3,
                                 norm_topk_prob=True)
    torch.testing.assert_close(sum(shares), whole, rtol=1e-12, atol=1e-12)


def test_an_expert_offset_reads_nothing_on_the_host():
    args = make(30, 8, torch.float32)
    with HostReadWatch() as watch:
        capturable.sparse_moe(**dict(args, experts_gate_up=args["experts_gate_up"][5:15],
                                     experts_down=args["experts_down"][5:15]),
                              expert_offset=5, top_k=3, norm_topk_prob=True)
    assert watch.seen == []
