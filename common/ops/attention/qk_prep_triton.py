"""Triton q/k norm + partial NeoX RoPE + paged KV store of a full-attention layer, in one launch.

Same contract as :func:`common.ops.attention.qk_prep_reference.qk_norm_rope_store`, which is
``rms_norm`` (zero-centred) of q and k, ``apply_rope`` of both and ``store_paged_kv`` of the rotated
k and of v; the separate Triton kernels take four launches for what this one does in one.

The arithmetic is those kernels', step by step, so that the results agree with the reference as
theirs do:

* norm: the head widened to fp32, ``sum(x * x) * (1 / D)``, ``rsqrt(ms + eps)`` (libdevice's, as
  torch's), ``(x * r) * (1 + w)`` in fp32, rounded once to the tensor's dtype (the reference rounds
  the norm's output before RoPE reads it, so the rotation starts from rounded values);
* rotary: fp32 angles ``positions * inv_freq``, libdevice cos / sin rounded to the dtype, each of
  ``x * cos`` and ``rotate_half(x) * sin`` rounded to the dtype, then their sum rounded; dims past
  ``2 * len(inv_freq)`` pass through;
* store: the rotated k rounded to k.dtype, then cast to kv.dtype (as ``.to`` does), and v cast.

FMA contraction is off, so every product is rounded where torch rounds it. Only the order of the
sum of squares differs from torch's reduction (a last-bit difference of the fp32 norm).

Grid: one program per (token, head) over the H q heads followed by the KVH kv heads. A program
holds one head of D values as a [BD] vector; the partner of each rotary column (its other NeoX
half) is loaded a second time (from cache) rather than moved between lanes. A kv-head program
also writes k and v into the cache slot ``loc[t]``, read on the GPU: nothing syncs with the host,
so the launch can be captured in a CUDA graph and replayed after positions and loc are rewritten.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.ops.attention import qk_prep_reference as reference
from common.ops.triton_math import INTERPRET as _INTERPRET, cos_sin as _cos_sin, rsqrt as _rsqrt

__all__ = ["qk_norm_rope_store"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 8192  # one head held in registers up to this width; wider goes to the reference
_LATENCY_GRID = 512  # (token, head) programs up to which a launch is latency bound


@triton.jit
def _norm_rotate(src, w, stride_w, o, d, partner, mask, lo, rot, cos, sin, inv_d, eps):
    """One head at ``src`` [BD]: zero-centred RMSNorm rounded to o's dtype, then the NeoX rotation
    of its first 2 * half columns, as fp32 holding values of o's dtype."""
    ty = o.dtype.element_ty
    x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    r = _rsqrt(tl.sum(x * x, axis=0) * inv_d + eps)
    wv = tl.load(w + d * stride_w, mask=mask, other=0.0).to(tl.float32)
    n = ((x * r) * (1.0 + wv)).to(ty).to(tl.float32)
    pmask = mask & rot
    xp = tl.load(src + partner, mask=pmask, other=0.0).to(tl.float32)
    wp = tl.load(w + partner * stride_w, mask=pmask, other=0.0).to(tl.float32)
    npart = ((xp * r) * (1.0 + wp)).to(ty).to(tl.float32)
    npart = tl.where(lo, -npart, npart)  # rotate_half: [-x2, x1]
    c = cos.to(ty).to(tl.float32)
    s = sin.to(ty).to(tl.float32)
    y = (n * c).to(ty).to(tl.float32) + (npart * s).to(ty).to(tl.float32)
    return tl.where(rot, y, n)


@triton.jit
def _qk_prep_kernel(
    q, sqt, sqh, k, skt, skh, v, svt, svh, qw, sqw, kw, skw, positions, sp, inv_freq, sf,
    qo, ko, kv, s_page, s_kv, s_off, s_head, loc, sloc,
    H, KVH, D, half, page_size, inv_d, eps,
    BD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BD)
    mask = d < D
    lo = d < half
    rot = d < 2 * half
    partner = tl.where(lo, d + half, d - half)  # read only where rot
    # column d and its partner share frequency d mod half, so both get the same cos / sin bits
    f = tl.load(inv_freq + tl.where(lo, d, d - half) * sf, mask=rot, other=0.0).to(tl.float32)
    angle = tl.load(positions + t * sp).to(tl.float32) * f
    cos, sin = _cos_sin(angle)
    if h < H:
        y = _norm_rotate(q + t * sqt + h * sqh, qw, sqw, qo, d, partner, mask, lo, rot, cos, sin,
                         inv_d, eps)
        tl.store(qo + (t * H + h) * D + d, y.to(qo.dtype.element_ty), mask=mask)
    else:
        hk = (h - H).to(tl.int64)
        y = _norm_rotate(k + t * skt + hk * skh, kw, skw, ko, d, partner, mask, lo, rot, cos, sin,
                         inv_d, eps)
        ky = y.to(ko.dtype.element_ty)
        tl.store(ko + (t * KVH + hk) * D + d, ky, mask=mask)
        slot = tl.load(loc + t * sloc).to(tl.int64)
        dst = kv + (slot // page_size) * s_page + (slot % page_size) * s_off + hk * s_head + d
        cache_ty = kv.dtype.element_ty
        tl.store(dst, ky.to(cache_ty), mask=mask)
        vt = tl.load(v + t * svt + hk * svh + d, mask=mask)
        tl.store(dst + s_kv, vt.to(cache_ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
               k_weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               kv: torch.Tensor, loc: torch.Tensor) -> bool:
    tensors = (q, k, v, q_weight, k_weight, positions, inv_freq, kv, loc)
    if not all((t.is_cuda or _INTERPRET) and t.device == kv.device for t in tensors):
        return False
    if any(t.dtype not in _DTYPES for t in (q, k, v, q_weight, k_weight, inv_freq, kv)):
        return False
    kv_in_place = kv.stride(-1) == 1 or kv.shape[-1] <= 1  # kv cannot be copied: it is the output
    return kv_in_place and q.shape[2] <= _MAX_HEAD_DIM


def _launch(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
            k_weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
            kv: torch.Tensor, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel launch on arguments already checked and supported (CPU tensors allowed under
    ``TRITON_INTERPRET=1``)."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    t, h, d = q.shape
    kvh = k.shape[1]
    qo = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(t, kvh, d, dtype=k.dtype, device=k.device)
    if t == 0 or d == 0 or h + kvh == 0:
        return qo, ko
    bd = triton.next_power_of_2(d)
    programs = t * (h + kvh)
    # a decode-sized grid is latency bound: more warps per head shorten each program (H200, D=256,
    # T=1: 2.2 us with 4 warps, 2.7 with 1); a large grid is throughput bound: fewer warps per
    # head keep more programs resident (T=2048: 39 us with 1 warp, 53 with 4)
    warps = 4 if programs <= _LATENCY_GRID else 2 if programs <= 8 * _LATENCY_GRID else 1
    _qk_prep_kernel[(t, h + kvh)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        q_weight, q_weight.stride(0), k_weight, k_weight.stride(0), positions, positions.stride(0),
        inv_freq, inv_freq.stride(0), qo, ko,
        kv, kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), loc, loc.stride(0),
        h, kvh, d, inv_freq.shape[0], kv.shape[2], 1.0 / d, eps,
        BD=bd, num_warps=max(1, min(warps, bd // 64)), enable_fp_fusion=False)
    return qo, ko


def qk_norm_rope_store(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                       inv_freq: torch.Tensor, kv: torch.Tensor,
                       loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`common.ops.attention.qk_prep_reference.qk_norm_rope_store` (same
    contract), in one launch.

    q, k and v may be strided views with contiguous last dims (others are copied first); kv is
    written in place through its own strides. CPU tensors, fp64 or other dtypes, a kv whose last
    dim is not contiguous, or tensors on different devices go to the reference.

    Returns:
        (q, k) normalised and rotated: new contiguous [T, H, D] and [T, KVH, D] tensors.
    """
    args = dict(q=q, k=k, v=v, q_weight=q_weight, k_weight=k_weight, positions=positions,
                inv_freq=inv_freq, kv=kv, loc=loc)
    reference.check_qk_prep_args(**args)
    if not _supported(**args):
        return reference.qk_norm_rope_store(eps=eps, **args)
    return _launch(eps=eps, **args)
