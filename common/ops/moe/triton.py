"""Triton sparse MoE for decode sizes: the chosen experts' weights read in place, by id.

Same contract as :func:`common.ops.moe.reference.sparse_moe`, and like the ``capturable``
backend it reads nothing on the host, so CUDA graphs replay it. Where ``capturable`` gathers
each chosen expert's weights into a copy before its batched GEMVs (reading them three times
over, and about 25 launches a layer), the router GEMV and three kernels do the whole block:

1. ``_route_kernel``: softmax over the router logits, top-k by repeated argmax, optional
   renormalisation, one program per token (the logits come from our GEMV before it);
2. ``_gate_up_kernel``: per token-expert pair, the expert's gate and up rows against the token,
   with the SwiGLU activation in the epilogue -> act [T*k, I]; and per token, the same for the
   shared expert (-> [T, I_s]) and its sigmoid gate;
3. ``_down_kernel``: per token, each chosen expert's down rows against its activation, weighted
   and summed over the k experts in fp32, plus the gated shared expert, rounded once -> [T, H].

Every pair reads its expert's weights once, so this serves while pairs are few against the
experts (``T * k <= E``, decode batches up to 32 for Qwen3.5-35B-A3B's 8 of 256); more tokens
go to the ``capturable`` backend, whose dense path reads every expert once whatever T. Up to 8
tokens the shared expert rides in the routed kernels as one more pair per token rather than as
its own GEMVs and activation (about ten launches a layer of a few microseconds each); beyond
that it is the reference's arithmetic with its projections through our ``linear`` op, which
reads its weights once for all tokens.

With expert parallelism (``expert_offset``) the router still picks among all the experts; a
pair whose expert another rank holds runs a held expert with weight 0 and adds exactly 0
(``capturable.held_pairs``): the kernels keep one program per pair, and such a pair's weight
reads are a held expert's, again, which stay in L2.

Roundings follow the reference: logits rounded to x.dtype, softmax and top-k in fp32, weights
rounded to x.dtype; each expert projection rounded to x.dtype (fp32 accumulation), silu and the
product rounded as ``silu_and_mul``; the weighted sum in fp32, here in top-k order (the
reference sums in expert-id order, so the last fp32 bit may differ), then the shared expert
added in fp32 and one final rounding. Ties in top-k pick the lower expert id, as torch.topk does
on the GPU for distinct values; exactly equal probabilities may order differently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common.ops.linear.triton import linear
from common.ops.moe import capturable, reference
from common.ops.triton_math import INTERPRET as _INTERPRET, exp as _exp

__all__ = ["sparse_moe", "MAX_TOKENS"]

MAX_TOKENS = capturable.MAX_TOKENS
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK_N = 4  # weight rows per program: thousands of programs even at one token
_BLOCK_K = 512
# Up to this many tokens the shared expert rides in the routed kernels, each token's programs
# reading the shared weights. On H200 (benchmarks/moe.py, 35B-A3B shape, against the shared
# expert through our linear op): 30 against 51 us per layer at 1 token, 121 against 145 at 8;
# folded at 32 tokens it took 418 against 372, where one GEMM over the tokens reads them once.
_FOLD_SHARED_TOKENS = 8


@triton.jit
def _route_kernel(logits, stride_l, ids, weights, E, TOP_K: tl.constexpr,
                  BLOCK_TOP: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    ok = cols < E
    z = tl.load(logits + t * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
    p = _exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(ok, p, -1.0)
    ks = tl.arange(0, BLOCK_TOP)
    top_w = tl.zeros((BLOCK_TOP,), tl.float32)
    top_i = tl.zeros((BLOCK_TOP,), tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        at = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)  # the lowest id among ties
        top_w = tl.where(ks == j, best, top_w)
        top_i = tl.where(ks == j, at.to(tl.int64), top_i)
        p = tl.where(cols == at, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(ids + t * TOP_K + ks, top_i, mask=ks < TOP_K)
    tl.store(weights + t * TOP_K + ks, top_w.to(weights.dtype.element_ty), mask=ks < TOP_K)


@triton.jit
def _load(ptrs, ok, EVEN: tl.constexpr):
    """``ptrs`` loaded in fp32; where ``ok`` is False, 0 (no mask at all when EVEN)."""
    if EVEN:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=ok, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _rows_dot(a_row, rows, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr):
    """``rows . a`` for BLOCK_N weight rows (pointers at each row's start, [BLOCK_N, 1]) against
    one K-vector ``a``, in fp32, unrounded -> [BLOCK_N]."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        a = _load(a_row + ks, k_ok, EVEN_K)[None, :]
        acc += _load(rows + ks[None, :], k_ok[None, :], EVEN_K) * a
    return tl.sum(acc, axis=1)


@triton.jit
def _gate_up_kernel(x, stride_x, ids, w, stride_we, stride_wn, act, I, H, P,
                    sg, su, stride_sn, seg, sact, sgate, IS,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr):
    """Programs ``[0, P)`` along axis 0: the routed token-expert pairs; ``[P, P + T)`` (when a
    shared expert is given): each token's shared expert, whose row-0 program also stores the
    token's shared gate ``sigmoid(x . seg)`` in the reference's roundings. Both kinds run one
    code path on selected pointers (a branch around the main loop measured slower)."""
    pair = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    shared = pair >= P
    t = tl.where(shared, pair - P, pair // TOP_K)
    n = tl.where(shared, IS, I)
    n_ok = rn < n
    rows = tl.where(n_ok, rn, 0).to(tl.int64)[:, None]
    expert = tl.load(ids + pair, mask=pair < P, other=0)
    routed_gate = w + expert * stride_we + rows * stride_wn
    gate = tl.where(shared, sg + rows * stride_sn, routed_gate)
    up = tl.where(shared, su + rows * stride_sn, routed_gate + I * stride_wn)
    out = tl.where(shared, sact + t * IS, act + pair * I)
    x_row = x + t * stride_x
    rk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < H
        xk = _load(x_row + ks, k_ok, EVEN_K)[None, :]
        acc_g += _load(gate + ks[None, :], k_ok[None, :], EVEN_K) * xk
        acc_u += _load(up + ks[None, :], k_ok[None, :], EVEN_K) * xk
    ty = act.dtype.element_ty
    # each projection rounded to the dtype, then silu_and_mul's roundings
    gv = tl.sum(acc_g, axis=1).to(ty).to(tl.float32)
    uv = tl.sum(acc_u, axis=1).to(ty).to(tl.float32)
    s = tl.math.div_rn(gv, 1.0 + _exp(-gv)).to(ty).to(tl.float32)
    tl.store(out + rn, (s * uv).to(ty), mask=n_ok)
    if shared and tl.program_id(1) == 0:
        gate_row = seg + tl.zeros((1, 1), tl.int64)  # the gate projection's one weight row
        logit = tl.sum(_rows_dot(x_row, gate_row, H, 1, BLOCK_K, EVEN_K), axis=0)
        logit = logit.to(ty).to(tl.float32)  # the projection's rounding
        tl.store(sgate + t, tl.math.div_rn(1.0, 1.0 + _exp(-logit)).to(ty))


@triton.jit
def _down_kernel(act, ids, weights, w, stride_we, stride_wn, out, H, I,
                 sdown, stride_sdn, sact, sgate, IS,
                 TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_KS: tl.constexpr,
                 EVEN_KS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    rows = tl.where(n_ok, rn, 0).to(tl.int64)[:, None]
    ty = act.dtype.element_ty
    total = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        down = w + tl.load(ids + pair) * stride_we + rows * stride_wn
        y = _rows_dot(act + pair * I, down, I, BLOCK_N, BLOCK_K, EVEN_K)
        y = y.to(ty).to(tl.float32)  # the expert's output in the dtype
        total += y * tl.load(weights + pair).to(tl.float32)
    if SHARED:
        # the reference's shared expert: its down projection and the gate product each rounded
        # to the dtype, then added to the routed sum in fp32
        y = _rows_dot(sact + t * IS, sdown + rows * stride_sdn, IS, BLOCK_N, BLOCK_KS,
                      EVEN_KS).to(ty).to(tl.float32)
        gate = tl.load(sgate + t).to(tl.float32)
        total += (gate * y).to(ty).to(tl.float32)
    tl.store(out + t * H + rn, total.to(out.dtype.element_ty), mask=n_ok)


def _route(x, router_weight, top_k, norm_topk_prob) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] (int64) and weights [T, k] in x.dtype (the logits from our GEMV)."""
    t, num_experts = x.shape[0], router_weight.shape[0]
    logits = linear(x=x, weight=router_weight.to(x.dtype))  # rounded to x.dtype
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(t, top_k, dtype=x.dtype, device=x.device)
    _route_kernel[(t,)](logits, logits.stride(0), ids, weights, num_experts, TOP_K=top_k,
                        BLOCK_TOP=triton.next_power_of_2(top_k),
                        BLOCK_E=triton.next_power_of_2(num_experts), RENORM=norm_topk_prob)
    return ids, weights


def _block_k(n: int) -> int:
    return min(_BLOCK_K, triton.next_power_of_2(n))


def _routed(x, ids, weights, gate_up, down, shared, out_dtype) -> torch.Tensor:
    """The weighted expert outputs plus the gated shared expert (``shared``: its four weights,
    or None), summed in fp32 and stored as ``out_dtype``, [T, H]."""
    t, hidden = x.shape
    top_k = ids.shape[1]
    inter = down.shape[2]
    act = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    if shared is None:
        # unused pointers and sizes: no shared program is launched
        sg = su = seg = sdown = sact = sgate = act
        inter_s, stride_sn, stride_sdn = 0, 0, 0
    else:
        sg, su, sdown, seg = shared
        inter_s, stride_sn, stride_sdn = sg.shape[0], sg.stride(0), sdown.stride(0)
        sact = torch.empty(t, inter_s, dtype=x.dtype, device=x.device)
        sgate = torch.empty(t, dtype=x.dtype, device=x.device)
    block_k = _block_k(hidden)
    programs = t * top_k + (t if shared is not None else 0)
    _gate_up_kernel[(programs, triton.cdiv(max(inter, inter_s), _BLOCK_N))](
        x, x.stride(0), ids, gate_up, gate_up.stride(0), gate_up.stride(1), act, inter, hidden,
        t * top_k, sg, su, stride_sn, seg, sact, sgate, inter_s,
        TOP_K=top_k, BLOCK_N=_BLOCK_N, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0)
    out = torch.empty(t, hidden, dtype=out_dtype, device=x.device)
    block_k, block_ks = _block_k(inter), _block_k(max(inter_s, 1))
    _down_kernel[(t, triton.cdiv(hidden, _BLOCK_N))](
        act, ids, weights, down, down.stride(0), down.stride(1), out, hidden, inter,
        sdown, stride_sdn, sact, sgate, inter_s,
        TOP_K=top_k, BLOCK_N=_BLOCK_N, BLOCK_K=block_k, EVEN_K=inter % block_k == 0,
        SHARED=shared is not None, BLOCK_KS=block_ks, EVEN_KS=inter_s % block_ks == 0)
    return out


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
    """Same contract as :func:`common.ops.moe.reference.sparse_moe`; no host read. Serves
    ``T * top_k <= E`` tokens with expert weights in x.dtype and a last dim of stride 1; other
    calls go to the ``capturable`` backend."""
    shared = (shared_gate_proj, shared_up_proj, shared_down_proj, shared_expert_gate)
    t, _, num_experts, _ = reference.check_moe_args(
        x=x, router_weight=router_weight, experts_gate_up=experts_gate_up,
        experts_down=experts_down, top_k=top_k, shared=shared, expert_offset=expert_offset)
    weights_in_place = all(w.dtype == x.dtype and w.stride(-1) == 1 for w in (
        experts_gate_up, experts_down, *(w for w in shared if w is not None))) and (
        shared_gate_proj is None or shared_gate_proj.stride(0) == shared_up_proj.stride(0))
    if (not (x.is_cuda or _INTERPRET) or x.dtype not in _DTYPES or t == 0
            or t * top_k > num_experts or t > MAX_TOKENS or not weights_in_place):
        return capturable.sparse_moe(
            x=x, router_weight=router_weight, experts_gate_up=experts_gate_up,
            experts_down=experts_down, top_k=top_k, norm_topk_prob=norm_topk_prob,
            shared_gate_proj=shared_gate_proj, shared_up_proj=shared_up_proj,
            shared_down_proj=shared_down_proj, shared_expert_gate=shared_expert_gate,
            expert_offset=expert_offset)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids, weights = _route(x, router_weight, top_k, norm_topk_prob)
    if expert_offset is not None:
        ids, weights = capturable.held_pairs(ids, weights, expert_offset,
                                             experts_gate_up.shape[0])
    if shared_expert_gate is None or t <= _FOLD_SHARED_TOKENS:
        return _routed(x, ids, weights, experts_gate_up, experts_down,
                       shared if shared_expert_gate is not None else None, x.dtype)
    out = _routed(x, ids, weights, experts_gate_up, experts_down, None, torch.float32)
    return (out + _shared_expert(x, *shared).to(torch.float32)).to(x.dtype)


def _shared_expert(x, gate_proj, up_proj, down_proj, expert_gate) -> torch.Tensor:
    """:func:`common.ops.moe.reference.shared_expert` with its projections through ``linear``:
    ``sigmoid(x @ expert_gate.T) * down(silu(gate(x)) * up(x))`` in x.dtype."""
    act = F.silu(linear(x=x, weight=gate_proj)) * linear(x=x, weight=up_proj)
    mlp = linear(x=act, weight=down_proj)
    return torch.sigmoid(linear(x=x, weight=expert_gate)) * mlp

