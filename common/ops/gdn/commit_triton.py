"""Triton commit of a speculative verify into the GDN pool (see ``commit_reference``).

Two launches for all layers (a grid axis per layer), no host read (the accepted lengths stay on the device, so the commit can
follow acceptance without a synchronisation and can be captured):

1. ``_commit_state_kernel``, one program per (value-head V-block, request x value head, layer): the
   slot's state block stays in registers while the program walks the accepted tokens; each
   token's k and v are the silu conv of the recorded rows (the slot's old window supplies the
   taps before the first token), its gates come from the recorded ``a``, ``b``. Same arithmetic
   and order as the conv, gating and recurrence kernels EXTEND runs, so the state matches theirs.
2. ``_commit_window_kernel``, one program per (request, channel block, layer): the new window is the
   last W-1 inputs of ``old window | accepted rows``. It runs after (1) on the stream, because
   (1) reads the old window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.ops.gdn import commit_reference as reference
from common.ops.gdn._common import INTERPRET, on_gpu
from common.ops.triton_math import exp, log1p

__all__ = ["gdn_commit_in_place"]

_SOFTPLUS_THRESHOLD = 20.0  # F.softplus's default, as the gating kernel uses


@triton.jit
def _conv_taps(qkv, stride_r, pool, i_s, s_s, s_d, s_w, w, stride_wd, row0, t, ch, m_ch,
               W: tl.constexpr):
    """silu causal conv at token ``t`` for channels ``ch``, rounded to the io dtype: taps in
    order, each from the recorded rows or, before the first token, the slot's old window."""
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for s in tl.static_range(W):
        # a tensor, not a scalar: the interpreter rejects a scalar condition inside a mask
        src = t - (W - 1) + s + ch * 0
        xv = tl.load(qkv + (row0 + src) * stride_r + ch, mask=m_ch & (src >= 0), other=0.0)
        sv = tl.load(pool + i_s * s_s + ch * s_d + (src + W - 1) * s_w, mask=m_ch & (src < 0),
                     other=0.0)
        val = tl.where(src >= 0, xv.to(tl.float32), sv.to(tl.float32))
        wv = tl.load(w + ch * stride_wd + s, mask=m_ch, other=0.0).to(tl.float32)
        acc = acc + val * wv
    acc = acc * tl.sigmoid(acc)
    return acc.to(qkv.dtype.element_ty).to(tl.float32)


@triton.jit
def _commit_state_kernel(
    qkv, q_l, stride_r, a, a_l, stride_a, b, b_l, stride_b, accepted, slots,
    conv, c_l, c_s, c_d, c_w, w, w_l, stride_wd, A_log, al_l, dt_bias, dt_l,
    ssm, h_l, h_s, h_h, h_v, h_k, block,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, W: tl.constexpr, THRESHOLD: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_hk = i_hv // (HV // HK)
    i_l = tl.program_id(2).to(tl.int64)
    qkv += i_l * q_l
    a += i_l * a_l
    b += i_l * b_l
    conv += i_l * c_l
    w += i_l * w_l
    ssm += i_l * h_l
    length = tl.load(accepted + i_n).to(tl.int64)
    i_s = tl.load(slots + i_n).to(tl.int64)
    row0 = i_n * block

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    ch_k = HK * K + i_hk * K + o_k
    ch_v = 2 * HK * K + i_hv * V + o_v

    # state block [BK, BV] K-major, read from the K-last pool row
    p_h = ssm + i_s * h_s + i_hv * h_h + o_k[:, None] * h_k + o_v[None, :] * h_v
    b_h = tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
    alog = tl.load(A_log + i_l * al_l + i_hv).to(tl.float32)
    bias = tl.load(dt_bias + i_l * dt_l + i_hv).to(tl.float32)
    for t in range(0, length):
        b_k = _conv_taps(qkv, stride_r, conv, i_s, c_s, c_d, c_w, w, stride_wd, row0, t, ch_k,
                         m_k, W)
        b_v = _conv_taps(qkv, stride_r, conv, i_s, c_s, c_d, c_w, w, stride_wd, row0, t, ch_v,
                         m_v, W)
        x = tl.load(a + (row0 + t) * stride_a + i_hv).to(tl.float32) + bias
        sp = tl.where(x > THRESHOLD, x, log1p(exp(tl.minimum(x, THRESHOLD))))
        b_g = -exp(alog) * sp
        bv = tl.load(b + (row0 + t) * stride_b + i_hv).to(tl.float32)
        b_beta = tl.math.div_rn(1.0, 1.0 + exp(-bv))
        b_k = b_k * (1.0 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6))
        b_h = b_h * tl.exp(b_g)
        b_delta = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
        b_h = b_h + b_k[:, None] * b_delta[None, :]
    tl.store(p_h, b_h.to(ssm.dtype.element_ty), mask=m_h)


@triton.jit
def _commit_window_kernel(
    qkv, q_l, stride_r, accepted, slots, conv, c_l, c_s, c_d, c_w, block, D,
    W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64)
    qkv += i_l * q_l
    conv += i_l * c_l
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    length = tl.load(accepted + n).to(tl.int64)
    i_s = tl.load(slots + n).to(tl.int64)
    cols = tl.arange(0, BW)[None, :]
    live = mask_d[:, None] & (cols < W - 1)
    i = length + cols  # index into cat(old window, accepted rows)
    from_rows = i >= W - 1
    xv = tl.load(qkv + (n * block + i - (W - 1)) * stride_r + offs_d[:, None],
                 mask=live & from_rows, other=0.0)
    row = conv + i_s * c_s + offs_d[:, None] * c_d
    sv = tl.load(row + i * c_w, mask=live & (i < W - 1), other=0.0)
    val = tl.where(from_rows, xv.to(conv.dtype.element_ty), sv)
    # other threads of this program may still be reading the old window columns being replaced
    tl.debug_barrier()
    tl.store(row + cols * c_w, val, mask=live)


def _supported(*tensors: torch.Tensor) -> bool:
    return (on_gpu(*tensors) or INTERPRET) and all(t.stride(-1) == 1 for t in tensors)


def gdn_commit_in_place(
    *,
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    block: int,
    accepted: torch.Tensor,
    conv_pool: torch.Tensor,
    conv_weight: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    num_v_heads: int,
    scale: float | None = None,
) -> None:
    """Triton version of :func:`common.ops.gdn.commit_reference.gdn_commit_in_place` (same
    contract). ``accepted`` and ``slots`` must live on the pools' device; neither is read on the
    host, so out-of-range values are out-of-bounds accesses, not errors."""
    args = dict(qkv=qkv, a=a, b=b, block=block, accepted=accepted, conv_pool=conv_pool,
                conv_weight=conv_weight, ssm_pool=ssm_pool, slots=slots, A_log=A_log,
                dt_bias=dt_bias, num_k_heads=num_k_heads, num_v_heads=num_v_heads)
    if not _supported(qkv, a, b, conv_weight, A_log, dt_bias):
        return reference.gdn_commit_in_place(**args, scale=scale)
    layers, n, dk, dv, width = reference.check_commit(**args)
    for name, t in (("accepted", accepted), ("slots", slots)):
        if t.device != ssm_pool.device:
            raise ValueError(f"{name} must be on the pools' device ({ssm_pool.device}), got {t.device}")
    if n == 0:
        return
    accepted = accepted.contiguous()
    slots = slots.contiguous()
    hv = num_v_heads
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), 8 if bk >= 128 else 16)
    _commit_state_kernel[(triton.cdiv(dv, bv), n * hv, layers)](
        qkv, *qkv.stride()[:2], a, *a.stride()[:2], b, *b.stride()[:2], accepted, slots,
        conv_pool, *conv_pool.stride(), conv_weight, *conv_weight.stride()[:2],
        A_log, A_log.stride(0), dt_bias, dt_bias.stride(0), ssm_pool, *ssm_pool.stride(), block,
        HK=num_k_heads, HV=hv, K=dk, V=dv, BK=bk, BV=bv, W=width,
        THRESHOLD=_SOFTPLUS_THRESHOLD, num_warps=1 if bk * bv <= 1024 else 4,
    )
    conv_dim = qkv.shape[2]
    bd = 128
    _commit_window_kernel[(n, triton.cdiv(conv_dim, bd), layers)](
        qkv, *qkv.stride()[:2], accepted, slots, conv_pool, *conv_pool.stride(), block, conv_dim,
        W=width, BW=triton.next_power_of_2(max(width - 1, 1)), BD=bd,
    )
