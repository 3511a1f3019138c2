"""The Triton walk shared by the speculative verify and its commit: GDN tokens replayed from a
pool slot, with the conv and the gates computed inside the walk.

One program per (value-head V-block, request x value head, layer). The slot's state block
``[K, BV]`` stays in registers while the program walks the request's tokens. Each token's q, k
and v are the silu conv of the pre-conv rows (the slot's conv window supplies the taps before
the first token), its gates come from the raw ``a``, ``b``. The arithmetic and its order are
those of the conv, gating and recurrence kernels EXTEND runs (fp32, the conv output rounded to
the io dtype, l2-normalised q and k with 1e-6 added to the sum of squares), so the state and
outputs match theirs. With a conv of width 4 (every released checkpoint) the window slides in
registers: one new row per token, loaded a token ahead, instead of four taps reloaded per token
(the walk is latency-bound: 3x less time a DFLASH step on the H200, docs/training.md).

- verify (``OUTPUT``): token outputs are written; the pool is only read.
- commit (``STORE``): the final state is written back to the slot; no outputs.

The conv window itself is not written here: whoever needs the new window writes it after this
kernel (other programs of the walk read the old one).
"""

from __future__ import annotations

import triton
import triton.language as tl

from common.ops.triton_math import exp, log1p

__all__ = ["replay_kernel", "launch_replay", "value_block", "SOFTPLUS_THRESHOLD"]

SOFTPLUS_THRESHOLD = 20.0  # F.softplus's default, as the gating kernel uses


@triton.jit
def _conv_taps(qkv, stride_r, pool, i_s, s_s, s_d, s_w, w, stride_wd, row0, t, ch, m_ch,
               W: tl.constexpr):
    """silu causal conv at token ``t`` for channels ``ch``, rounded to the io dtype: taps in
    order, each from the rows or, before the first token, the slot's window."""
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
def _row(qkv, stride_r, row, ch, m_ch):
    """One token's pre-conv values of channels ``ch`` in fp32 (zeros where masked)."""
    return tl.load(qkv + row * stride_r + ch, mask=m_ch, other=0.0).to(tl.float32)


@triton.jit
def _window_weights(w, stride_wd, ch, m_ch):
    """The four conv taps' weights of channels ``ch`` (fp32)."""
    w0 = tl.load(w + ch * stride_wd + 0, mask=m_ch, other=0.0).to(tl.float32)
    w1 = tl.load(w + ch * stride_wd + 1, mask=m_ch, other=0.0).to(tl.float32)
    w2 = tl.load(w + ch * stride_wd + 2, mask=m_ch, other=0.0).to(tl.float32)
    w3 = tl.load(w + ch * stride_wd + 3, mask=m_ch, other=0.0).to(tl.float32)
    return w0, w1, w2, w3


@triton.jit
def _window_start(pool, i_s, s_s, s_d, s_w, ch, m_ch):
    """The slot's conv window (the three inputs before the first token), fp32."""
    p = pool + i_s * s_s + ch * s_d
    x0 = tl.load(p + 0 * s_w, mask=m_ch, other=0.0).to(tl.float32)
    x1 = tl.load(p + 1 * s_w, mask=m_ch, other=0.0).to(tl.float32)
    x2 = tl.load(p + 2 * s_w, mask=m_ch, other=0.0).to(tl.float32)
    return x0, x1, x2


@triton.jit
def _conv4(x0, x1, x2, x3, w0, w1, w2, w3):
    """silu of a width-4 conv, the taps added in _conv_taps' order (fp32, not rounded)."""
    acc = tl.zeros(x0.shape, dtype=tl.float32)
    acc = acc + x0 * w0
    acc = acc + x1 * w1
    acc = acc + x2 * w2
    acc = acc + x3 * w3
    return acc * tl.sigmoid(acc)


@triton.jit
def _delta_step(b_h, b_k, b_v, x, bv, alog, THRESHOLD: tl.constexpr):
    """One token of the gated delta rule on the state block: ``x`` is the raw ``a`` plus
    dt_bias, ``bv`` the raw ``b``; k is l2-normalised here."""
    sp = tl.where(x > THRESHOLD, x, log1p(exp(tl.minimum(x, THRESHOLD))))
    b_g = -exp(alog) * sp
    b_beta = tl.math.div_rn(1.0, 1.0 + exp(-bv))
    b_k = b_k * (1.0 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6))
    b_h = b_h * tl.exp(b_g)
    b_delta = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
    return b_h + b_k[:, None] * b_delta[None, :]


@triton.jit
def _output(b_h, b_q, scale):
    """A token's output from the state after it: q l2-normalised and scaled."""
    b_q = b_q * (1.0 / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)) * scale
    return tl.sum(b_h * b_q[:, None], 0)


@triton.jit
def replay_kernel(
    qkv, q_l, stride_r, a, a_l, stride_a, b, b_l, stride_b, lengths, cu, slots,
    conv, c_l, c_s, c_d, c_w, w, w_l, stride_wd, A_log, al_l, dt_bias, dt_l,
    ssm, h_l, h_s, h_h, h_v, h_k, o, block, scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, W: tl.constexpr, THRESHOLD: tl.constexpr,
    USE_CU: tl.constexpr, OUTPUT: tl.constexpr, STORE: tl.constexpr,
):
    """Request n's tokens are rows ``cu[n]..cu[n+1]`` (``USE_CU``) or the first ``lengths[n]``
    of rows ``n*block..``; ``o`` is ``[rows, HV, V]`` indexed like the rows."""
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
    if USE_CU:
        row0 = tl.load(cu + i_n).to(tl.int64)
        length = tl.load(cu + i_n + 1).to(tl.int64) - row0
    else:
        row0 = i_n * block
        length = tl.load(lengths + i_n).to(tl.int64)
    i_s = tl.load(slots + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    ch_q = i_hk * K + o_k
    ch_k = HK * K + ch_q
    ch_v = 2 * HK * K + i_hv * V + o_v

    # state block [BK, BV] K-major, read from the K-last pool row
    p_h = ssm + i_s * h_s + i_hv * h_h + o_k[:, None] * h_k + o_v[None, :] * h_v
    b_h = tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
    alog = tl.load(A_log + i_l * al_l + i_hv).to(tl.float32)
    bias = tl.load(dt_bias + i_l * dt_l + i_hv).to(tl.float32)
    if W == 4:
        # the conv window slides in registers: each token loads one new pre-conv row (the
        # next token's, ahead of its use, so its latency hides behind this token's walk),
        # and the taps are summed in the same order as _conv_taps, so the bits are the same
        wk0, wk1, wk2, wk3 = _window_weights(w, stride_wd, ch_k, m_k)
        wv0, wv1, wv2, wv3 = _window_weights(w, stride_wd, ch_v, m_v)
        k0, k1, k2 = _window_start(conv, i_s, c_s, c_d, c_w, ch_k, m_k)
        v0, v1, v2 = _window_start(conv, i_s, c_s, c_d, c_w, ch_v, m_v)
        nk = _row(qkv, stride_r, row0, ch_k, m_k & (length > 0))
        nv = _row(qkv, stride_r, row0, ch_v, m_v & (length > 0))
        na = tl.load(a + row0 * stride_a + i_hv, mask=length > 0, other=0.0).to(tl.float32)
        nb = tl.load(b + row0 * stride_b + i_hv, mask=length > 0, other=0.0).to(tl.float32)
        if OUTPUT:
            wq0, wq1, wq2, wq3 = _window_weights(w, stride_wd, ch_q, m_k)
            q0, q1, q2 = _window_start(conv, i_s, c_s, c_d, c_w, ch_q, m_k)
            nq = _row(qkv, stride_r, row0, ch_q, m_k & (length > 0))
        for t in range(0, length):
            k3, v3, x, bv = nk, nv, na + bias, nb
            more = t + 1 < length
            nk = _row(qkv, stride_r, row0 + t + 1, ch_k, m_k & more)
            nv = _row(qkv, stride_r, row0 + t + 1, ch_v, m_v & more)
            na = tl.load(a + (row0 + t + 1) * stride_a + i_hv, mask=more, other=0.0).to(
                tl.float32)
            nb = tl.load(b + (row0 + t + 1) * stride_b + i_hv, mask=more, other=0.0).to(
                tl.float32)
            if OUTPUT:
                q3 = nq
                nq = _row(qkv, stride_r, row0 + t + 1, ch_q, m_k & more)
            b_k = _conv4(k0, k1, k2, k3, wk0, wk1, wk2, wk3).to(qkv.dtype.element_ty).to(
                tl.float32)
            b_v = _conv4(v0, v1, v2, v3, wv0, wv1, wv2, wv3).to(qkv.dtype.element_ty).to(
                tl.float32)
            k0, k1, k2 = k1, k2, k3
            v0, v1, v2 = v1, v2, v3
            b_h = _delta_step(b_h, b_k, b_v, x, bv, alog, THRESHOLD)
            if OUTPUT:
                b_q = _conv4(q0, q1, q2, q3, wq0, wq1, wq2, wq3).to(qkv.dtype.element_ty).to(
                    tl.float32)
                q0, q1, q2 = q1, q2, q3
                tl.store(o + ((row0 + t) * HV + i_hv) * V + o_v,
                         _output(b_h, b_q, scale).to(o.dtype.element_ty), mask=m_v)
    else:
        for t in range(0, length):
            b_k = _conv_taps(qkv, stride_r, conv, i_s, c_s, c_d, c_w, w, stride_wd, row0, t, ch_k,
                             m_k, W)
            b_v = _conv_taps(qkv, stride_r, conv, i_s, c_s, c_d, c_w, w, stride_wd, row0, t, ch_v,
                             m_v, W)
            x = tl.load(a + (row0 + t) * stride_a + i_hv).to(tl.float32) + bias
            bv = tl.load(b + (row0 + t) * stride_b + i_hv).to(tl.float32)
            b_h = _delta_step(b_h, b_k, b_v, x, bv, alog, THRESHOLD)
            if OUTPUT:
                b_q = _conv_taps(qkv, stride_r, conv, i_s, c_s, c_d, c_w, w, stride_wd, row0, t,
                                 ch_q, m_k, W)
                tl.store(o + ((row0 + t) * HV + i_hv) * V + o_v,
                         _output(b_h, b_q, scale).to(o.dtype.element_ty), mask=m_v)
    if STORE:
        tl.store(p_h, b_h.to(ssm.dtype.element_ty), mask=m_h)


def value_block(dk: int, dv: int) -> int:
    """Value columns per program (``BV``) of a GDN recurrence walk (this replay and the
    decode/prefill kernel of ``triton.py``): the state block ``[K, BV]`` stays in registers, so
    fewer with K >= 128; more programs also keep more SMs busy at small batches."""
    return min(triton.next_power_of_2(dv), 8 if triton.next_power_of_2(dk) >= 128 else 16)


def launch_replay(*, qkv, a, b, slots, conv_pool, conv_weight, A_log, dt_bias,
                  ssm_pool, o, block: int, scale: float, num_k_heads: int, n: int,
                  output: bool, store: bool, lengths=None, cu=None) -> None:
    """One launch of :func:`replay_kernel` over layer-stacked tensors (a leading dim L on
    qkv, a, b, the pools, conv_weight, A_log and dt_bias; L = 1 for a single layer).
    Exactly one of ``lengths`` (the first ``lengths[n]`` of rows ``n*block..``) and ``cu``
    (rows ``cu[n]..cu[n+1]``) says which rows are each request's; ``o`` is written only with
    ``output``."""
    if (lengths is None) == (cu is None):
        raise ValueError("give exactly one of lengths and cu")
    layers, _, hv, dv, dk = ssm_pool.shape
    bk, bv = triton.next_power_of_2(dk), value_block(dk, dv)
    replay_kernel[(triton.cdiv(dv, bv), n * hv, layers)](
        qkv, *qkv.stride()[:2], a, *a.stride()[:2], b, *b.stride()[:2],
        lengths if cu is None else cu, cu if lengths is None else lengths, slots,
        conv_pool, *conv_pool.stride(), conv_weight, *conv_weight.stride()[:2],
        A_log, A_log.stride(0), dt_bias, dt_bias.stride(0), ssm_pool, *ssm_pool.stride(), o,
        block, scale,
        HK=num_k_heads, HV=hv, K=dk, V=dv, BK=bk, BV=bv, W=conv_weight.shape[-1],
        THRESHOLD=SOFTPLUS_THRESHOLD, USE_CU=cu is not None, OUTPUT=output, STORE=store,
        num_warps=1 if bk * bv <= 1024 else 4,
    )
