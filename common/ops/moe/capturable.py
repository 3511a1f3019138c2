"""Sparse MoE without a host read, for CUDA graphs: the same block as ``reference.sparse_moe``.

The reference groups tokens by expert on the host (``torch.unique(...).tolist()``), which a
captured graph cannot replay. Here every shape is fixed by the number of tokens T alone, so a
forward of up to :data:`MAX_TOKENS` tokens can be captured:

- **gathered** (few token-expert pairs, ``3 * T * top_k <= E``): the chosen experts' weights are
  gathered per pair (``index_select``) and applied with batched GEMVs. It reads each chosen
  expert three times (gather read, copy written, GEMV read), so it pays while the pairs are few
  against the E experts.
- **dense** (more pairs): every expert runs on every token, one GEMM for all gate/up projections
  and one batched GEMM for the down projections, and unchosen experts get weight 0. It reads
  every expert once, whatever T.

Larger T (prefill, which is never captured) goes to the reference.

With expert parallelism (``expert_offset``) tokens are routed over all the router's experts as
always; a pair whose expert another rank holds gets weight 0 and a held expert's id in its
place (:func:`held_pairs`), so shapes stay fixed by T and the pair adds exactly 0.

Written in plain torch rather than as a fused grouped-GEMM kernel: these paths need no kernel
of our own to be correct, and at decode batch sizes they are bound by reading expert weights,
which both do at most three times over (gathered) or once (dense).

Roundings follow the reference: each expert's projections in x.dtype (fp32 accumulation), the
routing weights rounded to x.dtype, the weighted sum over experts in fp32 (here in top-k or
expert order, so the last fp32 bit may differ), the shared expert added in fp32, one final
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.ops.mlp.reference import silu_and_mul
from common.ops.moe import reference

__all__ = ["sparse_moe", "held_pairs", "MAX_TOKENS"]

MAX_TOKENS = 64  # dense intermediates are T x E x (2I) values: 32 MiB at T = 64, E = 256, I = 512


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
    """Same contract as :func:`common.ops.moe.reference.sparse_moe`; no host read for up to
    :data:`MAX_TOKENS` tokens."""
    shared = (shared_gate_proj, shared_up_proj, shared_down_proj, shared_expert_gate)
    t, hidden, num_experts, _ = reference.check_moe_args(
        x=x, router_weight=router_weight, experts_gate_up=experts_gate_up,
        experts_down=experts_down, top_k=top_k, shared=shared, expert_offset=expert_offset)
    if t > MAX_TOKENS or t == 0:
        return reference.sparse_moe(
            x=x, router_weight=router_weight, experts_gate_up=experts_gate_up,
            experts_down=experts_down, top_k=top_k, norm_topk_prob=norm_topk_prob,
            shared_gate_proj=shared_gate_proj, shared_up_proj=shared_up_proj,
            shared_down_proj=shared_down_proj, shared_expert_gate=shared_expert_gate,
            expert_offset=expert_offset)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    ids, weights = reference.route(x, router_weight, top_k, norm_topk_prob, acc)
    held = experts_gate_up.shape[0]
    if expert_offset is not None:
        ids, weights = held_pairs(ids, weights, expert_offset, held)
    if 3 * t * top_k <= held:
        out = _gathered(x, ids, weights, experts_gate_up, experts_down, acc)
    else:
        out = _dense(x, ids, weights, experts_gate_up, experts_down, acc)
    if shared_expert_gate is not None:
        out = out + reference.shared_expert(x, *shared).to(acc)
    return out.to(x.dtype)


def held_pairs(ids: torch.Tensor, weights: torch.Tensor, offset: int,
               held: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-expert pairs over the ``held`` experts ``offset ..`` of this rank: each id made
    local, and a pair whose expert is not held given weight 0 and a held id (which adds 0)."""
    local = ids - offset
    mine = (local >= 0) & (local < held)
    return local.clamp(0, held - 1), weights.masked_fill(~mine, 0)


def _gathered(x, ids, weights, gate_up, down, acc) -> torch.Tensor:
    """Routed output [T, H] in ``acc``, from the chosen experts' weights gathered per pair."""
    t, k = ids.shape
    pairs = ids.reshape(-1)                                   # pair p is token p // k
    xs = x.unsqueeze(1).expand(t, k, x.shape[1]).reshape(t * k, -1, 1)       # [P, H, 1]
    h = torch.bmm(gate_up.index_select(0, pairs).to(x.dtype), xs).squeeze(-1)   # [P, 2I]
    act = silu_and_mul(x=h).unsqueeze(-1)                     # [P, I, 1]
    y = torch.bmm(down.index_select(0, pairs).to(x.dtype), act).squeeze(-1)     # [P, H]
    return (y.to(acc).view(t, k, -1) * weights.to(acc).unsqueeze(-1)).sum(1)


def _dense(x, ids, weights, gate_up, down, acc) -> torch.Tensor:
    """Routed output [T, H] in ``acc``: every expert on every token, unchosen ones weighted 0."""
    t = x.shape[0]
    num_experts, two_i, hidden = gate_up.shape
    h = F.linear(x, gate_up.reshape(num_experts * two_i, hidden).to(x.dtype))  # [T, E*2I]
    act = silu_and_mul(x=h.view(t, num_experts, two_i))                        # [T, E, I]
    y = torch.bmm(act.transpose(0, 1), down.transpose(1, 2).to(x.dtype))       # [E, T, H]
    dense_w = torch.zeros(t, num_experts, dtype=acc, device=x.device)
    # added, not set: under expert parallelism a pair of another rank's expert shares a held
    # expert's id with weight 0 (a token picks each expert at most once, so a sum is its weight)
    dense_w.scatter_add_(1, ids, weights.to(acc))
    return torch.einsum("te,eth->th", dense_w, y.to(acc))
