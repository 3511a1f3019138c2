"""Triton MoE against the reference on the GPU: Qwen3.5-35B-A3B's shapes and odd ones.

The expert projections round where the reference rounds; the fp32 sum over the k experts runs in
top-k order instead of expert-id order, so bf16 outputs may differ in the last bit. The router's
choice is compared too: same experts, same weights.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.moe import reference
from tests.common.compare import randn, rel_rmse

pytestmark = pytest.mark.gpu


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.moe import triton as moe_triton

    return moe_triton


def make(gen, tokens, experts, hidden, inter, shared, dtype) -> dict:
    def r(*shape, scale=1.0):
        return randn(gen, *shape, dtype=dtype) * scale

    return dict(x=r(tokens, hidden), router_weight=r(experts, hidden, scale=hidden ** -0.5),
                experts_gate_up=r(experts, 2 * inter, hidden, scale=hidden ** -0.5),
                experts_down=r(experts, hidden, inter, scale=inter ** -0.5),
                shared_gate_proj=r(shared, hidden, scale=hidden ** -0.5),
                shared_up_proj=r(shared, hidden, scale=hidden ** -0.5),
                shared_down_proj=r(hidden, shared, scale=shared ** -0.5),
                shared_expert_gate=r(1, hidden, scale=hidden ** -0.5))


@pytest.mark.parametrize("tokens", [1, 3, 32])
def test_qwen35_moe_shapes_bf16(record_metric, tokens):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    args = make(gen, tokens, 256, 2048, 512, 512, torch.bfloat16)
    got = tr.sparse_moe(**args, top_k=8, norm_topk_prob=True)
    want = reference.sparse_moe(**args, top_k=8, norm_topk_prob=True)
    err = rel_rmse(got.double(), want.double())
    record_metric("rel_rmse", err)
    assert err <= 4e-3


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_odd_shapes(record_metric, renorm, dtype):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(7)
    args = make(gen, 5, 61, 200, 72, 36, dtype)
    got = tr.sparse_moe(**args, top_k=7, norm_topk_prob=renorm)
    want = reference.sparse_moe(**args, top_k=7, norm_topk_prob=renorm)
    err = rel_rmse(got.double(), want.double())
    record_metric(f"rel_rmse_{dtype}", err)
    assert err <= (1e-6 if dtype == torch.float32 else 4e-3)


def test_router_picks_the_reference_experts():
    """Same experts and weights per token. bf16 logits tie often (a 1/128 ulp near the top-k
    boundary), and the order among tied experts is the sort's, so sets are compared; a tie at
    the boundary itself takes the lower expert id in both (torch's top-k gathers ties in index
    order)."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = randn(gen, 17, 2048, dtype=torch.bfloat16)
    router = randn(gen, 256, 2048, dtype=torch.bfloat16) * 2048 ** -0.5
    ids, weights = tr._route(x, router, 8, True)
    want_ids, want_w = reference.route(x, router, 8, True, torch.float32)
    assert torch.equal(ids.sort(dim=1).values, want_ids.sort(dim=1).values)
    order, want_order = ids.argsort(dim=1), want_ids.argsort(dim=1)
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order),
                               rtol=2 ** -7, atol=1e-6)


def test_many_tokens_go_to_the_capturable_op(monkeypatch):
    tr = _triton()
    from common.ops.moe import capturable

    calls = []
    real = capturable.sparse_moe
    monkeypatch.setattr(capturable, "sparse_moe", lambda **kw: calls.append(1) or real(**kw))
    gen = torch.Generator(device="cuda").manual_seed(2)
    args = make(gen, 33, 256, 256, 64, 64, torch.bfloat16)  # 33 * 8 pairs > 256 experts
    tr.sparse_moe(**args, top_k=8, norm_topk_prob=True)
    assert calls == [1]


def test_replays_in_a_cuda_graph():
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(4)
    args = make(gen, 2, 256, 2048, 512, 512, torch.bfloat16)
    tr.sparse_moe(**args, top_k=8, norm_topk_prob=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tr.sparse_moe(**args, top_k=8, norm_topk_prob=True)
    args["x"].copy_(randn(gen, 2, 2048, dtype=torch.bfloat16))
    graph.replay()
    assert torch.equal(out, tr.sparse_moe(**args, top_k=8, norm_topk_prob=True))


@pytest.mark.parametrize("ranks", [2, 8])
@pytest.mark.parametrize("tokens", [1, 32])
def test_expert_parallel_shares_bf16(record_metric, ranks, tokens):
    """Each of ``ranks`` expert-parallel ranks' share (its 256/ranks experts, routed over all
    256, the shared expert's columns on rank 0 only here) against the reference's, and the
    shares' sum against the whole block."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(20 + tokens)
    args = make(gen, tokens, 256, 2048, 512, 512, torch.bfloat16)
    gate_up, down = args.pop("experts_gate_up"), args.pop("experts_down")
    shared = {k: args.pop(k) for k in ("shared_gate_proj", "shared_up_proj", "shared_down_proj",
                                       "shared_expert_gate")}
    held = 256 // ranks
    total = torch.zeros(tokens, 2048, dtype=torch.float64, device="cuda")
    worst = 0.0
    for r in range(ranks):
        part = dict(args, experts_gate_up=gate_up[r * held:(r + 1) * held],
                    experts_down=down[r * held:(r + 1) * held], expert_offset=r * held,
                    top_k=8, norm_topk_prob=True, **(shared if r == 0 else {}))
        got = tr.sparse_moe(**part)
        want = reference.sparse_moe(**part)
        if want.abs().max() > 0:  # a rank none of whose experts was picked gives exact zeros
            worst = max(worst, rel_rmse(got.double(), want.double()))
        else:
            assert torch.equal(got, want)
        total += got.double()
    whole = reference.sparse_moe(**args, experts_gate_up=gate_up, experts_down=down, top_k=8,
                                 norm_topk_prob=True, **shared)
    record_metric("worst share rel_rmse", worst)
    assert worst <= 4e-3
    assert rel_rmse(total, whole.double()) <= 8e-3
