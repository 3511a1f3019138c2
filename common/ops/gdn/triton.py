"""Our own Triton gated-delta-rule recurrence (decode, speculative verify) with per-token states.

Why a kernel of our own: verification of k draft tokens needs the recurrent state *after every
token* so that any accepted prefix can be committed (``output_intermediate_states=True`` of
``common.ops.gdn.reference.recurrent_gated_delta_rule``). fla-core 0.6.0's
``fused_recurrent_gated_delta_rule`` returns only the final state; FlashInfer's
``gated_delta_rule_mtp`` writes intermediate states but takes raw gate projections and the K-last
pool with slot indices (SM90, 128-dim heads only), not our op's inputs. This kernel takes exactly the
op's inputs (log-space ``g``, post-sigmoid ``beta``, packed tokens via ``cu_seqlens``, K-major
``[N, HV, K, V]`` state, strided q/k/v rows) and writes, on request, ``[T, HV, K, V]`` fp32 states.

Per program: one (sequence, value head, V-block); the fp32 state block ``[K, BV]`` stays in
registers across the sequence's tokens, like fla's kernel. Per token, in the reference's order:
``S *= exp(g); delta = beta (v - k^T S); S += k delta^T; o = S^T (scale * q)`` with q, k
l2-normalised (eps 1e-6 added to the sum of squares) when requested.

The same kernel also serves ``gdn_decode_in_place`` (``SLOTS``): one token per request, the
state read from and written back to the pool row ``slots[n]``. Each program reads its whole
(slot, head, V-block) tile before it writes it and no other program touches that tile (slots are
distinct, scratch slot 0 aside), so updating in place needs no second buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.ops.gdn import reference
from common.ops.gdn._common import INTERPRET, check_in_place, check_shapes, device_cu, on_gpu
from common.ops.gdn.replay_triton import SOFTPLUS_THRESHOLD, value_block
from common.ops.triton_math import exp, log1p

__all__ = ["recurrent_gated_delta_rule", "gdn_decode_in_place"]


@triton.jit
def _recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu, slots, h0, ht, inter, o,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    s0_n, s0_h, s0_k, s0_v,
    st_n, st_h, st_k, st_v,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_INTER: tl.constexpr, SLOTS: tl.constexpr,
    GATES: tl.constexpr, THRESHOLD: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_hk = i_hv // (HV // HK)
    if SLOTS:
        # one token per request (token n), state row slots[n] of the pool for both h0 and ht
        bos = i_n
        eos = i_n + 1
        i_s = tl.load(slots + i_n).to(tl.int64)
    else:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
        i_s = i_n

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        p_h0 = h0 + i_s * s0_n + i_hv * s0_h + o_k[:, None] * s0_k + o_v[None, :] * s0_v
        b_h += tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)

    if GATES:
        alog = tl.load(A_log + i_hv).to(tl.float32)
        bias = tl.load(dt_bias + i_hv).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + t * stride_qt + i_hk * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + t * stride_kt + i_hk * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + t * stride_vt + i_hv * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
        if GATES:
            # g and beta formed here from the raw projections, as the gating kernel forms them
            x = tl.load(g + t * stride_gt + i_hv).to(tl.float32) + bias
            sp = tl.where(x > THRESHOLD, x, log1p(exp(tl.minimum(x, THRESHOLD))))
            b_g = -exp(alog) * sp
            b_raw = tl.load(beta + t * stride_bt + i_hv).to(tl.float32)
            b_beta = tl.math.div_rn(1.0, 1.0 + exp(-b_raw))
        else:
            b_g = tl.load(g + t * stride_gt + i_hv).to(tl.float32)
            b_beta = tl.load(beta + t * stride_bt + i_hv).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q * (1.0 / tl.sqrt(tl.sum(b_q * b_q) + 1e-6))
            b_k = b_k * (1.0 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6))
        b_q = b_q * scale
        b_h = b_h * tl.exp(b_g)
        b_delta = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
        b_h = b_h + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if STORE_INTER:
            p_i = inter + ((t * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
            tl.store(p_i, b_h, mask=m_h)

    p_ht = ht + i_s * st_n + i_hv * st_h + o_k[:, None] * st_k + o_v[None, :] * st_v
    tl.store(p_ht, b_h.to(ht.dtype.element_ty), mask=m_h)


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
    """Triton version of :func:`common.ops.gdn.reference.recurrent_gated_delta_rule` (same contract).

    ``initial_state`` may be any strided ``[N, HV, K, V]`` view (e.g. the transpose of K-last pool
    rows); it is read in place and never written. The final state comes back in the same memory
    order as the initial state (a transposed view over ``[N, HV, V, K]`` storage when the input
    was one), so handing it back to a K-last pool is a plain copy. CPU (outside the Triton
    interpreter) and fp64 inputs go to the reference.
    """
    if not (on_gpu(q, k, v, g, beta, initial_state) or INTERPRET) or any(
            t is not None and t.dtype == torch.float64 for t in (q, k, v, g, beta, initial_state)):
        return reference.recurrent_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
            scale=scale, use_qk_l2norm=use_qk_l2norm, output_intermediate_states=output_intermediate_states)
    t, hk, dk, hv, dv, n = check_shapes(q, k, v, g, beta, cu_seqlens, initial_state)
    dev = v.device
    cu, _ = device_cu(cu_seqlens, dev)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g = g if g.stride(-1) == 1 else g.contiguous()
    beta = beta if beta.stride(-1) == 1 else beta.contiguous()
    o = torch.empty(t, hv, dv, dtype=v.dtype, device=dev)
    # the final state keeps the initial state's memory order (K-last storage stays K-last)
    v_first = initial_state is not None and initial_state.stride(-2) == 1 and initial_state.stride(-1) != 1
    if v_first:
        final = torch.empty(n, hv, dv, dk, dtype=torch.float32, device=dev).transpose(-1, -2)
    else:
        final = torch.empty(n, hv, dk, dv, dtype=torch.float32, device=dev)
    inter = torch.empty(t, hv, dk, dv, dtype=torch.float32, device=dev) if output_intermediate_states else o
    h0 = initial_state if initial_state is not None else final
    s0 = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    # cu stands in for the unused slots pointer
    _launch(q, k, v, g, beta, cu, cu, h0, final, inter, o, s0, final.stride(), scale,
            hk=hk, hv=hv, dk=dk, dv=dv, n=n, use_qk_l2norm=use_qk_l2norm,
            has_h0=initial_state is not None, store_inter=output_intermediate_states, in_place=False)
    if output_intermediate_states:
        return o, final, inter
    return o, final


def _launch(q, k, v, g, beta, cu, slots, h0, ht, inter, o, s0, st, scale, *, hk, hv, dk, dv, n,
            use_qk_l2norm, has_h0, store_inter, in_place, gates=None):
    """One launch of ``_recurrent_kernel``; s0 / st are the K-major strides of h0 / ht.
    ``gates``: (A_log, dt_bias) when g and beta are the raw projections a and b."""
    A_log, dt_bias = gates if gates is not None else (g, g)  # unused pointers otherwise
    bk, bv = triton.next_power_of_2(dk), value_block(dk, dv)
    grid = (triton.cdiv(dv, bv), n * hv)
    _recurrent_kernel[grid](
        q, k, v, g, beta, A_log, dt_bias, cu, slots, h0, ht, inter, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0),
        *s0, *st,
        dk ** -0.5 if scale is None else scale,
        HK=hk, HV=hv, K=dk, V=dv, BK=bk, BV=bv,
        USE_L2NORM=use_qk_l2norm, HAS_H0=has_h0, STORE_INTER=store_inter, SLOTS=in_place,
        GATES=gates is not None, THRESHOLD=SOFTPLUS_THRESHOLD,
        num_warps=1 if bk * bv <= 1024 else 4,
    )


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
    """Triton version of :func:`common.ops.gdn.reference.gdn_decode_in_place` (same contract).

    One launch, the gates formed inside it: no host synchronisation and no allocation besides
    ``o``, so the call can be captured in a CUDA graph with ``slots`` and the inputs updated in
    place between replays. ``ssm_pool`` may be any strided ``[S, HV, V, K]`` tensor (the pool's
    layer view is contiguous); ``slots`` must live on its device. Slots are not range-checked
    (that would need a host read): an index outside ``[0, S)`` is out-of-bounds memory access.
    CPU (outside the Triton interpreter) and fp64 inputs go to the reference.
    """
    tensors = (q, k, v, a, b, A_log, dt_bias, ssm_pool)
    if not (on_gpu(*tensors) or INTERPRET) or any(t.dtype == torch.float64 for t in tensors):
        return reference.gdn_decode_in_place(q=q, k=k, v=v, a=a, b=b, A_log=A_log,
                                             dt_bias=dt_bias, ssm_pool=ssm_pool, slots=slots,
                                             scale=scale, use_qk_l2norm=use_qk_l2norm)
    n, hk, dk, hv, dv, _ = check_in_place(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots)
    if slots.device != ssm_pool.device:
        raise ValueError(f"slots must be on the pool's device ({ssm_pool.device}), got {slots.device}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    slots = slots if slots.is_contiguous() else slots.contiguous()
    o = torch.empty(n, hv, dv, dtype=v.dtype, device=v.device)
    kmajor = ssm_pool.transpose(-1, -2).stride()  # [S, HV, K, V] strides of the K-last pool
    # slots stands in for the unused cu_seqlens and o for the unused intermediate states
    _launch(q, k, v, a, b, slots, slots, ssm_pool, ssm_pool, o, o, kmajor, kmajor, scale,
            hk=hk, hv=hv, dk=dk, dv=dv, n=n, use_qk_l2norm=use_qk_l2norm,
            has_h0=True, store_inter=False, in_place=True,
            gates=(A_log.contiguous(), dt_bias.contiguous()))
    return o
