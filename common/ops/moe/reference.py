"""Plain-torch sparse MoE block of Qwen3-Next / Qwen3.5-MoE: softmax top-k router, packed experts, shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.ops.mlp.reference import silu_and_mul, silu_glu_mlp

__all__ = ["sparse_moe", "route", "check_moe_args", "shared_expert"]


def route(x, router_weight, top_k, norm_topk_prob, dt):
    """Top-k expert ids [T, k] and their weights [T, k], rounded to x.dtype as transformers does."""
    # transformers forms the logits in x.dtype; rounding them the same way keeps bf16 expert choice identical.
    logits = (x.to(dt) @ router_weight.to(dt).T).to(x.dtype).to(dt)
    # Softmax over *all* experts first, then top-k: the kept weights do not sum to 1 unless renormalised.
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


def check_moe_args(*, x, router_weight, experts_gate_up, experts_down, top_k, shared,
                   expert_offset: int | None = None) -> tuple[int, int, int, int]:
    """ValueError unless the arguments of :func:`sparse_moe` fit; returns (T, H, E, I).
    ``shared``: the four shared-expert weights (all or none given). ``expert_offset``: the
    packed experts are experts ``expert_offset ..`` of the router's (None: all of them)."""
    shared_gate_proj, shared_up_proj, shared_down_proj, shared_expert_gate = shared
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    t, hidden = x.shape
    if router_weight.dim() != 2 or router_weight.shape[1] != hidden:
        raise ValueError(f"router_weight must be [E, {hidden}], got {tuple(router_weight.shape)}")
    num_experts = router_weight.shape[0]
    held = num_experts if expert_offset is None else experts_gate_up.shape[0]
    expert_offset = expert_offset or 0
    if expert_offset < 0 or expert_offset + held > num_experts:
        raise ValueError(f"experts {expert_offset}..{expert_offset + held - 1} are not all among the router's {num_experts}")
    if experts_gate_up.dim() != 3 or experts_gate_up.shape[0] != held or experts_gate_up.shape[2] != hidden:
        raise ValueError(f"experts_gate_up must be [{held}, 2I, {hidden}], got {tuple(experts_gate_up.shape)}")
    if experts_gate_up.shape[1] % 2:
        raise ValueError(f"experts_gate_up rows must be 2I (gate then up), got {experts_gate_up.shape[1]}")
    inter = experts_gate_up.shape[1] // 2
    if experts_down.shape != (held, hidden, inter):
        raise ValueError(f"experts_down must be [{held}, {hidden}, {inter}], got {tuple(experts_down.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if any(p is None for p in shared) and not all(p is None for p in shared):
        raise ValueError("give all four shared expert weights or none of them")
    if shared_expert_gate is not None and shared_expert_gate.shape != (1, hidden):
        raise ValueError(f"shared_expert_gate must be [1, {hidden}], got {tuple(shared_expert_gate.shape)}")
    return t, hidden, num_experts, inter


def sparse_moe(
    *,
    x: torch.Tensor,
    router_weight: torch.Tensor,
    experts_gate_up: torch.Tensor,
    experts_down: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    shared_gate_proj: torch.Tensor | None = None,
    shared_up_proj: torch.Tensor | None = None,
    shared_down_proj: torch.Tensor | None = None,
    shared_expert_gate: torch.Tensor | None = None,
    expert_offset: int | None = None,
) -> torch.Tensor:
    """Routed experts plus an optional sigmoid-gated shared expert.

    Router: logits ``x @ router_weight.T`` rounded to x.dtype, softmax in fp32 over all E experts,
    top_k, renormalised when norm_topk_prob (Qwen3.5-MoE always renormalises; Qwen3-Next follows its
    config), then rounded to x.dtype.
    ``out = sum_j w_j * down_e(silu(gate_e x) * up_e x) + sigmoid(x @ shared_expert_gate.T) * shared_mlp(x)``.
    Matmuls and the sum run in fp32 (fp64 for fp64 x).

    Args:
        x: [T, H].
        router_weight: [E, H].
        experts_gate_up: [E, 2I, H]; rows [:I] are the gate projection, [I:] the up projection.
        experts_down: [E, H, I].
        top_k: experts per token.
        norm_topk_prob: divide the kept weights by their sum.
        shared_gate_proj, shared_up_proj: [I_s, H]; shared_down_proj: [H, I_s];
        shared_expert_gate: [1, H]. Give all four or none.
        expert_offset: with expert parallelism, the packed experts are the router's experts
            ``expert_offset .. expert_offset + E_local - 1``: tokens are routed over all E as
            always, and only the held experts contribute (the caller sums the ranks' outputs).

    Returns:
        [T, H] in x.dtype.
    """
    t, hidden, _, _ = check_moe_args(
        x=x, router_weight=router_weight, experts_gate_up=experts_gate_up,
        experts_down=experts_down, top_k=top_k, shared=(shared_gate_proj, shared_up_proj,
                                                        shared_down_proj, shared_expert_gate),
        expert_offset=expert_offset)
    held, expert_offset = experts_gate_up.shape[0], expert_offset or 0
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    ids, weights = route(x, router_weight, top_k, norm_topk_prob, acc)
    # expert GEMMs in x's dtype (as transformers); the weighted sum over experts in fp32
    out = torch.zeros(t, hidden, dtype=acc, device=x.device)
    # Visit experts in ascending id, each over the tokens that picked it, so the sum order is fixed.
    for e in torch.unique(ids).tolist():
        if not expert_offset <= e < expert_offset + held:
            continue  # another rank's expert
        tok, slot = torch.where(ids == e)
        local = e - expert_offset
        act = silu_and_mul(x=F.linear(x[tok], experts_gate_up[local].to(x.dtype)))
        contrib = F.linear(act, experts_down[local].to(x.dtype)).to(acc) * weights[tok, slot, None].to(acc)
        out.index_add_(0, tok, contrib)
    if shared_expert_gate is not None:
        out = out + shared_expert(x, shared_gate_proj, shared_up_proj, shared_down_proj,
                                  shared_expert_gate).to(acc)
    return out.to(x.dtype)


def shared_expert(x, gate_proj, up_proj, down_proj, expert_gate) -> torch.Tensor:
    """``sigmoid(x @ expert_gate.T) * mlp(x)`` in x.dtype."""
    mlp = silu_glu_mlp(x=x, gate_proj=gate_proj, up_proj=up_proj, down_proj=down_proj)
    return torch.sigmoid(F.linear(x, expert_gate.to(x.dtype))) * mlp
