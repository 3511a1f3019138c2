"""Triton partial NeoX rotary embedding of q and k in one launch.

Same contract as :func:`common.ops.rope.reference.apply_rope`: the first ``r = 2 * len(inv_freq)``
dims of every head are rotated (NeoX halves), the rest are copied, and new tensors come back
(inputs are never written). The arithmetic is the reference's: fp32 angles
``positions * inv_freq``, cos/sin in fp32 rounded to the tensor's dtype, each of the products
``rot * cos`` and ``rotate_half(rot) * sin`` rounded to that dtype, then their sum rounded. On the
GPU cos and sin are libdevice's (torch's CUDA kernels call the same functions) and FMA contraction
is off, so bf16 and fp32 results can agree with the reference bit for bit.

q ``[T, H, D]`` and k ``[T, KVH, D]`` may be strided views (e.g. of a fused projection) as long as
the last dim is contiguous. Grid: one row of programs per token; each program takes a block of q
heads or of k heads and computes that token's cos/sin once.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from common.ops.rope import reference
from common.ops.triton_math import INTERPRET as _INTERPRET, cos_sin as _cos_sin

__all__ = ["apply_rope"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEADS = 16  # heads per program


@triton.jit
def _rotate_heads(x, stride_t, stride_h, o, t, h0, NH, D, half, cos, sin, j,
                  BHEADS: tl.constexpr, BREST: tl.constexpr):
    """Rotate heads h0 .. h0+BHEADS-1 of token t of x into contiguous o [T, NH, D]."""
    heads = h0 + tl.arange(0, BHEADS)
    mask_h = heads < NH
    mask = mask_h[:, None] & (j < half)[None, :]
    src = x + t * stride_t + heads.to(tl.int64)[:, None] * stride_h
    dst = o + (t * NH + heads.to(tl.int64))[:, None] * D
    ty = o.dtype.element_ty
    c = cos.to(ty).to(tl.float32)[None, :]
    s = sin.to(ty).to(tl.float32)[None, :]
    x1 = tl.load(src + j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + j[None, :], mask=mask, other=0.0).to(tl.float32)
    # rotate_half(rot) = [-x2, x1]; every product is rounded to the dtype before the sum
    y1 = (x1 * c).to(ty).to(tl.float32) + ((-x2) * s).to(ty).to(tl.float32)
    y2 = (x2 * c).to(ty).to(tl.float32) + (x1 * s).to(ty).to(tl.float32)
    tl.store(dst + j[None, :], y1.to(ty), mask=mask)
    tl.store(dst + half + j[None, :], y2.to(ty), mask=mask)
    if BREST > 0:  # dims past the rotary part pass through
        cols = 2 * half + tl.arange(0, BREST)
        m = mask_h[:, None] & (cols < D)[None, :]
        tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=m, other=0.0), mask=m)


@triton.jit
def _rope_kernel(
    q, stride_qt, stride_qh, k, stride_kt, stride_kh, qo, ko, positions, stride_p, inv_freq, stride_f,
    H, KVH, D, half, q_blocks,
    BHEADS: tl.constexpr, BHALF: tl.constexpr, BREST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    j = tl.arange(0, BHALF)
    f = tl.load(inv_freq + j * stride_f, mask=j < half, other=0.0).to(tl.float32)
    angle = tl.load(positions + t * stride_p).to(tl.float32) * f
    cos, sin = _cos_sin(angle)
    if blk < q_blocks:
        _rotate_heads(q, stride_qt, stride_qh, qo, t, blk * BHEADS, H, D, half, cos, sin, j,
                      BHEADS, BREST)
    else:
        _rotate_heads(k, stride_kt, stride_kh, ko, t, (blk - q_blocks) * BHEADS, KVH, D, half, cos, sin,
                      j, BHEADS, BREST)


def _supported(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda or _INTERPRET for t in tensors) and all(t.dtype != torch.float64 for t in tensors)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def apply_rope(
    *, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`common.ops.rope.reference.apply_rope` (same contract).

    Args:
        q: [T, H, D]. k: [T, KVH, D] (last dim contiguous, other strides free).
        positions: [T] integer absolute positions.
        inv_freq: [r / 2] with r <= D.

    Returns:
        (q, k) rotated, new contiguous tensors in q.dtype and k.dtype. CPU or fp64 tensors, and
        dtypes other than fp32 / fp16 / bf16, go to the reference.
    """
    if not _supported(q, k, positions, inv_freq) or q.dtype not in _DTYPES or k.dtype not in _DTYPES:
        return reference.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k [T, KVH, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if positions.shape != (q.shape[0],) or positions.is_floating_point():
        raise ValueError(f"positions must be an integer [{q.shape[0]}] tensor, got {tuple(positions.shape)}")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > q.shape[2]:
        raise ValueError(
            f"inv_freq must be [r/2] with r <= head dim {q.shape[2]}, got {tuple(inv_freq.shape)}")
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    t, h, d = q.shape
    kvh = k.shape[1]
    half = inv_freq.shape[0]
    qo = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(t, kvh, d, dtype=k.dtype, device=k.device)
    if t == 0 or d == 0 or h + kvh == 0:
        return qo, ko
    bheads = min(triton.next_power_of_2(max(h, kvh)), _MAX_HEADS)
    q_blocks, k_blocks = triton.cdiv(h, bheads), triton.cdiv(kvh, bheads)
    rest = d - 2 * half
    _rope_kernel[(t, q_blocks + k_blocks)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), qo, ko, positions, positions.stride(0),
        inv_freq, inv_freq.stride(0), h, kvh, d, half, q_blocks,
        BHEADS=bheads, BHALF=triton.next_power_of_2(max(half, 1)),
        BREST=triton.next_power_of_2(rest) if rest > 0 else 0,
        num_warps=4 if bheads * d >= 2048 else 1, enable_fp_fusion=False)
    return qo, ko
