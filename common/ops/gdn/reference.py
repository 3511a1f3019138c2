"""Plain-torch Gated DeltaNet kernels: gates, chunked (WY / UT) prefill and token recurrence.

The recurrent state is K-major ``[N, HV, K, V]`` (the transformers / fla convention). Work happens in
fp32, or in fp64 when the inputs are fp64 so that golden tests can compare two algorithms to ~1e-12.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.ops.gdn._common import check_in_place, check_shapes, sequence_bounds

__all__ = ["gdn_gating", "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gdn_decode_in_place"]

_L2NORM_EPS = 1e-6


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def gdn_gating(
    *, A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log decay and write strength of each value head.

    Args:
        A_log: [HV] learned log decay rate.
        a: [T, HV] decay projection.
        dt_bias: [HV].
        b: [T, HV] beta projection (before the sigmoid).

    Returns:
        g: [T, HV] ``-exp(A_log) * softplus(a + dt_bias)`` (always <= 0).
        beta: [T, HV] ``sigmoid(b)``.
        Both fp32, or fp64 when any input is fp64.
    """
    if a.dim() != 2 or b.shape != a.shape:
        raise ValueError(f"a and b must both be [T, HV], got {tuple(a.shape)} and {tuple(b.shape)}")
    hv = a.shape[1]
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(
            f"A_log and dt_bias must be [{hv}], got {tuple(A_log.shape)} and {tuple(dt_bias.shape)}"
        )
    dt = _compute_dtype(A_log, a, dt_bias, b)
    # g must never be formed in bf16: exp(A_log) * softplus spans several orders of magnitude.
    g = -torch.exp(A_log.to(dt)) * F.softplus(a.to(dt) + dt_bias.to(dt))
    beta = torch.sigmoid(b.to(dt))
    return g, beta


def _prepare(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    """Validate, cast, expand q/k to the value heads, and apply l2norm and scale once for all tokens."""
    t, hk, dk, hv, dv, n = check_shapes(q, k, v, g, beta, cu_seqlens, initial_state)
    bounds = sequence_bounds(cu_seqlens, t)

    dt = _compute_dtype(q, k, v)
    r = hv // hk
    # repeat_interleave, not repeat: value head j reads key head j // r.
    q = q.to(dt).repeat_interleave(r, dim=1)
    k = k.to(dt).repeat_interleave(r, dim=1)
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + _L2NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + _L2NORM_EPS)
    q = q * (dk**-0.5 if scale is None else scale)
    if initial_state is None:
        state = torch.zeros(n, hv, dk, dv, dtype=dt, device=v.device)
    else:
        # .to() aliases the caller's tensor when the dtype already matches; the clone keeps it unwritten.
        state = initial_state.to(dt).clone()
    return q, k, v.to(dt), g.to(dt), beta.to(dt), bounds, state


def _chunk_step(q, k, v, g, beta, s):
    """One chunk of one sequence, all heads at once.

    q, k: [HV, L, K]; v: [HV, L, V]; g, beta: [HV, L]; s: [HV, K, V] state entering the chunk.
    Returns the chunk output [HV, L, V] and the state leaving it.
    """
    size = g.shape[-1]
    gamma = g.cumsum(-1)  # [HV, L] log decay from the chunk start up to and including each token
    # Mask before exp: the upper triangle holds positive exponents that can overflow.
    causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    diff = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf"))
    decay = diff.exp()  # [HV, L, L], decay[i, j] = prod of alphas over (j, i]

    kb = k * beta[..., None]
    # (I + strictly_lower(beta_i k_i.k_j decay_ij))^-1 turns the L sequential rank-1 delta updates into
    # matmuls; unitriangular=True reads only the strict lower triangle and takes the diagonal as 1.
    system = (kb @ k.transpose(-1, -2)) * decay
    w = torch.linalg.solve_triangular(system, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    v_new = u - w @ s  # what each token writes once the incoming state's prediction is removed

    attn = (q @ k.transpose(-1, -2)) * decay  # zero above the diagonal already
    o = (q * gamma.exp()[..., None]) @ s + attn @ v_new
    last = gamma[:, -1:]
    s = s * last.exp()[..., None] + (k * (last - gamma).exp()[..., None]).transpose(-1, -2) @ v_new
    return o, s


def chunk_gated_delta_rule(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over packed sequences, chunk by chunk (WY / UT form).

    Args:
        q, k: [T, HK, K]. v: [T, HV, V], HV a multiple of HK (value head j uses key head j // (HV//HK)).
        g: [T, HV] log decay (<= 0). beta: [T, HV] write strength in (0, 1).
        cu_seqlens: integer [N+1] offsets of the N packed sequences.
        initial_state: [N, HV, K, V] or None for zeros; never modified.
        scale: multiplies q after the l2norm; default K**-0.5.
        use_qk_l2norm: l2-normalise q and k over K (eps 1e-6) first.
        chunk_size: tokens per chunk; the last chunk of each sequence may be shorter.

    Returns:
        o: [T, HV, V] in v.dtype.
        final_state: [N, HV, K, V] fp32 (fp64 when inputs are fp64).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    out_dtype = v.dtype
    q, k, v, g, beta, bounds, state = _prepare(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    # Head-major so every product inside a chunk is a matmul batched over heads.
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gh, bh = g.transpose(0, 1), beta.transpose(0, 1)
    o = torch.empty_like(vh)
    for seq, (start, end) in enumerate(zip(bounds, bounds[1:])):
        s = state[seq]
        for cs in range(start, end, chunk_size):
            ce = min(cs + chunk_size, end)
            o[:, cs:ce], s = _chunk_step(qh[:, cs:ce], kh[:, cs:ce], vh[:, cs:ce], gh[:, cs:ce], bh[:, cs:ce], s)
        state[seq] = s
    return o.transpose(0, 1).to(out_dtype).contiguous(), state


def recurrent_gated_delta_rule(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    output_intermediate_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated delta rule, one token at a time (decode, verify, and the golden model for the chunked form).

    Per token and value head: S = exp(g) S; delta = beta (v - k^T S); S += k (x) delta; o = S^T (scale q).

    Args:
        Same as ``chunk_gated_delta_rule`` (without chunk_size).
        output_intermediate_states: also return the state after every token.

    Returns:
        o: [T, HV, V] in v.dtype.
        final_state: [N, HV, K, V] fp32 (fp64 when inputs are fp64).
        intermediate_states (only when requested): [T, HV, K, V], same dtype as final_state;
            row t is the state of t's sequence right after token t.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, bounds, state = _prepare(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    o = torch.empty_like(v)
    inter = None
    if output_intermediate_states:
        inter = torch.empty(v.shape[0], *state.shape[1:], dtype=state.dtype, device=state.device)
    starts, lens = bounds[:-1], [e - s for s, e in zip(bounds, bounds[1:])]
    # Step all sequences together at each offset, so a decode batch (N sequences of one token) is one step.
    for i in range(max(lens, default=0)):
        seqs = [r for r, n in enumerate(lens) if n > i]
        tok = torch.tensor([starts[r] + i for r in seqs], dtype=torch.long, device=v.device)
        sel = torch.tensor(seqs, dtype=torch.long, device=v.device)
        s = state[sel] * g[tok].exp()[..., None, None]  # [n, HV, K, V]
        k_t = k[tok]
        kv_mem = (s * k_t[..., None]).sum(-2)
        delta = (v[tok] - kv_mem) * beta[tok][..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        o[tok] = (s * q[tok][..., None]).sum(-2)
        state[sel] = s
        if inter is not None:
            inter[tok] = s
    o = o.to(out_dtype)
    if inter is not None:
        return o, state, inter
    return o, state


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
    """One decode step of every request, reading and writing its state in the pool by slot.

    Exactly :func:`gdn_gating` of the raw gate projections, then
    :func:`recurrent_gated_delta_rule` with one token per request: the states of rows ``slots``
    are gathered, stepped, and written back into the same rows. (The gates are inputs here, not
    ``g`` and ``beta``, so a backend can form them inside its step.)

    Args:
        q, k: [N, HK, K]. v: [N, HV, V]. a, b: [N, HV] raw gate projections (as ``gdn_gating``
            takes them); A_log, dt_bias: [HV].
        ssm_pool: [S, HV, V, K] K-last states of one layer (``GDNStatePool.ssm[layer]``), updated
            in place; rows not named in ``slots`` are left untouched.
        slots: integer [N] pool row of each request. Rows must be distinct, except that padding
            rows may all name slot 0 (scratch): what lands there is unspecified.
        scale, use_qk_l2norm: as in :func:`recurrent_gated_delta_rule`.

    Returns:
        o: [N, HV, V] in v.dtype.
    """
    n = check_in_place(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots)[0]
    g, beta = gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    index = slots.to(device=ssm_pool.device, dtype=torch.long)
    o, final = recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=torch.arange(n + 1),
        initial_state=ssm_pool[index].transpose(-1, -2), scale=scale, use_qk_l2norm=use_qk_l2norm)
    ssm_pool[index] = final.transpose(-1, -2).to(ssm_pool.dtype)
    return o
