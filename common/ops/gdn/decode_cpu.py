"""The in-place GDN decode step in plain torch, fast on the CPU.

The reference (``reference.gdn_decode_in_place``) gathers the states, steps them through the
general recurrence (another copy, a gather by sequence, and a fresh state-sized tensor for
every product) and scatters them back: about ten passes over the states, each allocating.
Here each request's state is stepped where it lies in the pool: one read for both mat-vec
products (``S k`` and ``S q``), then a decay ``mul_`` and a rank-1 ``addcmul_`` in place, with
the output formed from the products (``S' q = decay S q + delta k.q``) instead of a third pass;
everything else is per head, not per state element. The numbers are the reference's to fp32
rounding (the same products, summed in another order; gate factors under e**-40 are taken as
0, see :data:`NEGLIGIBLE`).

The loop over requests reads the slots on the host, so this op is not for CUDA graphs.
"""

from __future__ import annotations

import math

import torch

from common.ops.gdn._common import check_in_place
from common.ops.gdn.reference import gdn_gating

__all__ = ["gdn_decode_in_place", "NEGLIGIBLE", "drop_negligible", "l2_normalised",
           "per_value_head"]

_L2NORM_EPS = 1e-6  # the reference's
# Values below this in magnitude are taken as exactly 0 where the gates can make them: gate
# factors (a decay exp(g), a write strength sigmoid(b)) and the chunked rule's solved keys,
# whose range is that of the decays compounded over a block. Trained models have gates far
# enough out for such values, and their products with the state land in the subnormal range,
# where x86 arithmetic runs 10-100x slower (a verify of 16 requests: 18 ms instead of 3). What
# is dropped is below e**-40 ~ 4e-18 of the term, far under the fp32 rounding of the sums it
# joins.
NEGLIGIBLE = math.exp(-40.0)


def drop_negligible(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the values of magnitude below :data:`NEGLIGIBLE` set to 0."""
    return x.masked_fill(x.abs() < NEGLIGIBLE, 0.0)


def l2_normalised(x: torch.Tensor, use_l2norm: bool, dim: int = -2) -> torch.Tensor:
    """``x`` l2-normalised over ``dim`` (eps as the reference's) when asked, else ``x``."""
    if not use_l2norm:
        return x
    return x * torch.rsqrt((x * x).sum(dim, keepdim=True) + _L2NORM_EPS)


def per_value_head(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[T, HK, ...] -> [T, HV, ...]: value head j reads key head j // (HV // HK)."""
    t, hk = x.shape[:2]
    if hk == num_v_heads:
        return x
    rest = x.shape[2:]
    return x.unsqueeze(2).expand(t, hk, num_v_heads // hk, *rest).reshape(t, num_v_heads, *rest)


def gdn_decode_in_place(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One decode step of every request on its pool row; the contract of
    ``reference.gdn_decode_in_place`` (same arguments, same result to fp32 rounding).

    Args:
        q, k: [N, HK, K]. v: [N, HV, V]. a, b: [N, HV] raw gate projections; A_log, dt_bias: [HV].
        ssm_pool: [S, HV, V, K] K-last states of one layer, updated in place; rows not named
            in ``slots`` are left untouched.
        slots: integer [N] pool rows; distinct, except that padding rows may all name slot 0.
        scale: query scale (default K**-0.5). use_qk_l2norm: l2-normalise q and k first.

    Returns:
        o: [N, HV, V] in v.dtype.
    """
    n, hk, dk, hv, dv, _ = check_in_place(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots)
    dt = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    g, beta = gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    decay = drop_negligible(g.to(dt).exp())[..., None]  # [N, HV, 1]
    beta = drop_negligible(beta.to(dt))
    # k and q as the last dim of one tensor: both products read each state once
    kq = l2_normalised(torch.stack([k, q], dim=-1).to(dt), use_qk_l2norm)  # [N, HK, K, 2]
    kq[..., 1] *= dk ** -0.5 if scale is None else scale
    k_dot_q = per_value_head(kq.prod(-1).sum(-1), hv)[..., None]  # [N, HV, 1]
    kq = per_value_head(kq, hv)  # [N, HV, K, 2]
    kv = kq[..., 0].unsqueeze(2).contiguous()  # [N, HV, 1, K]

    # Each request's state is stepped where it lies in the pool: a gather into a buffer and a
    # scatter back would cost two more passes over every state, more than a loop of views.
    # A pool in another dtype than the compute is stepped in a converted copy, written back.
    rows = slots.tolist()
    same = ssm_pool.dtype == dt
    states = [ssm_pool[r] if same else ssm_pool[r].to(dt) for r in rows]  # [HV, V, K] each
    # S k and S q in one read of each state; the decay is a per-head scalar, so it can scale
    # the products instead of the state
    sk, sq = torch.stack([torch.bmm(s, kq[i]) for i, s in enumerate(states)]).unbind(-1)
    delta = (v.to(dt) - decay * sk) * beta[..., None]  # [N, HV, V]
    # S' = decay S + delta (x) k, so S' q = decay (S q) + delta (k . q)
    o = decay * sq + delta * k_dot_q
    decay, delta = decay[..., None], delta[..., None]
    for i, s in enumerate(states):
        s.mul_(decay[i]).addcmul_(delta[i], kv[i])
        if not same:
            ssm_pool[rows[i]].copy_(s)
    return o.to(v.dtype)
