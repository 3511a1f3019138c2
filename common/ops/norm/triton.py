"""Triton RMSNorm, residual add + RMSNorm and gated RMSNorm: one launch per call, same contract as
``common.ops.norm.reference``.

Arithmetic follows the reference step by step: inputs widened to fp32, the mean square as
``sum(x * x) * (1 / H)`` (torch's CUDA mean multiplies by the reciprocal), ``rsqrt(ms + eps)``, and the
roundings where the reference rounds. rms_norm rounds once at the end. gated_rms_norm rounds the
normalised value to x.dtype, multiplies by the weight in ``promote(weight, x)`` (rounded there, as
torch's bf16 * bf16 is), then by ``silu(gate)`` in fp32, and rounds to x.dtype. add_rms_norm adds
x and the residual in fp32, rounds the sum to x.dtype (torch's add), stores it and normalises the
rounded sum as rms_norm does. FMA contraction is switched off so that every product is rounded
where torch rounds it; on the GPU exp and rsqrt are libdevice's, the functions torch's CUDA
kernels call.

``x`` is ``[..., H]`` with any leading strides as long as the last dim is contiguous (e.g. the q
half ``qg[..., :head_dim]`` of a ``[T, heads, 2 * head_dim]`` projection); only a non-contiguous
last dim, or more than four leading dims that no stride pattern merges, is copied; the gate or the
residual has its own strides of the same kind. Outputs are fresh contiguous tensors. Rows are
tiles of ``BR`` rows by ``BH`` columns; rows longer than ``_MAX_BLOCK_H`` are swept twice (sum of
squares, then the scaled output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.ops import pdl as _pdl
from common.ops.norm import reference
from common.ops.triton_math import INTERPRET as _INTERPRET, exp as _exp, rsqrt as _rsqrt

__all__ = ["rms_norm", "add_rms_norm", "gated_rms_norm"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK_H = 8192  # one row held in registers up to this width
_TILE = 4096  # elements per program when several short rows share one
_MAX_DIMS = 4  # leading dims the kernel indexes after merging; more are copied first

# epilogues
_PLAIN, _ZERO_CENTERED, _GATED = 0, 1, 2


@triton.jit
def _row_offsets(rows, n1, n2, n3, s0, s1, s2, s3):
    """Element offset of each row of a tensor whose leading dims are [n0, n1, n2, n3] with strides s."""
    rows = rows.to(tl.int64)
    i3 = rows % n3
    rest = rows // n3
    i2 = rest % n2
    rest = rest // n2
    i1 = rest % n1
    i0 = rest // n1
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3


@triton.jit
def _epilogue(n, w_ptr, stride_w, g_ptr, g_row, cols, H, mask, MODE: tl.constexpr,
              ROUND_PROD: tl.constexpr, out_ty: tl.constexpr):
    """The weighted (and gated) output of normalised fp32 values ``n`` [BR, BH], in fp32."""
    w = tl.load(w_ptr + cols * stride_w, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    if MODE == 1:
        return n * (1.0 + w)
    elif MODE == 0:
        return n * w
    else:
        p = w * n.to(out_ty).to(tl.float32)
        if ROUND_PROD:  # torch's weight * x̂ result dtype is x.dtype here, so it rounds there
            p = p.to(out_ty).to(tl.float32)
        gv = tl.load(g_ptr + g_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        silu = tl.math.div_rn(gv, 1.0 + _exp(-gv))  # torch: x / (1 + exp(-x)), IEEE division
        return p * silu


@triton.jit
def _load_rows(x, x_row, g, g_row, cols, mask, ADD: tl.constexpr, out_ty: tl.constexpr):
    """The values to normalise [BR, BH] in fp32: x, or with ADD the sum x + g rounded to out_ty
    (torch adds two bf16 tensors in fp32 and rounds the result once)."""
    xv = tl.load(x + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:
        rv = tl.load(g + g_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xv = (xv + rv).to(out_ty).to(tl.float32)
    return xv


@triton.jit
def _norm_kernel(
    x, sx0, sx1, sx2, sx3, g, sg0, sg1, sg2, sg3, w, stride_w, out, summed,
    n_rows, n1, n2, n3, H, inv_h, eps,
    MODE: tl.constexpr, ROUND_PROD: tl.constexpr, ADD: tl.constexpr, BR: tl.constexpr,
    BH: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr,
):
    """One tile of rows. ``g`` is the gate (MODE 2) or, with ADD, the residual, whose rounded sum
    with x is stored to ``summed`` and normalised in place of x."""
    _pdl.start(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    mask_r = rows < n_rows
    x_row = _row_offsets(rows, n1, n2, n3, sx0, sx1, sx2, sx3)
    if MODE == 2 or ADD:
        g_row = _row_offsets(rows, n1, n2, n3, sg0, sg1, sg2, sg3)
    else:
        g_row = x_row  # unused
    o_row = rows.to(tl.int64) * H
    out_ty = out.dtype.element_ty
    cols = tl.arange(0, BH)
    if CHUNKS == 1:
        mask = mask_r[:, None] & (cols < H)[None, :]
        xv = _load_rows(x, x_row, g, g_row, cols, mask, ADD, out_ty)
        if ADD:
            tl.store(summed + o_row[:, None] + cols[None, :], xv.to(out_ty), mask=mask)
        ms = tl.sum(xv * xv, axis=1) * inv_h
        r = _rsqrt(ms + eps)
        y = _epilogue(xv * r[:, None], w, stride_w, g, g_row, cols, H, mask, MODE, ROUND_PROD, out_ty)
        tl.store(out + o_row[:, None] + cols[None, :], y.to(out_ty), mask=mask)
    else:
        acc = tl.zeros([BR, BH], dtype=tl.float32)
        for c in range(CHUNKS):
            cc = c * BH + cols
            mask = mask_r[:, None] & (cc < H)[None, :]
            xv = _load_rows(x, x_row, g, g_row, cc, mask, ADD, out_ty)
            if ADD:
                tl.store(summed + o_row[:, None] + cc[None, :], xv.to(out_ty), mask=mask)
            acc += xv * xv
        r = _rsqrt(tl.sum(acc, axis=1) * inv_h + eps)
        for c in range(CHUNKS):
            cc = c * BH + cols
            mask = mask_r[:, None] & (cc < H)[None, :]
            # the sum is recomputed rather than read back from ``summed``: the same bits, and no
            # ordering needed between this program's store and its load
            xv = _load_rows(x, x_row, g, g_row, cc, mask, ADD, out_ty)
            y = _epilogue(xv * r[:, None], w, stride_w, g, g_row, cc, H, mask, MODE, ROUND_PROD, out_ty)
            tl.store(out + o_row[:, None] + cc[None, :], y.to(out_ty), mask=mask)


def _merged_rows(shape: tuple[int, ...],
                 *strides: tuple[int, ...]) -> tuple[list[int], list[list[int]]] | None:
    """Leading dims of ``shape`` (all but the last) merged where every tensor's strides allow, as
    (sizes, per-tensor strides), outermost first, padded to ``_MAX_DIMS``; None if more remain."""
    dims = [(n, [s[i] for s in strides]) for i, n in enumerate(shape[:-1]) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, st in reversed(dims):  # innermost first
        if merged and all(o == merged[-1][0] * i for o, i in zip(st, merged[-1][1])):
            merged[-1] = (n * merged[-1][0], merged[-1][1])
        else:
            merged.append((n, st))
    if len(merged) > _MAX_DIMS:
        return None
    merged += [(1, [0] * len(strides))] * (_MAX_DIMS - len(merged))
    merged.reverse()
    return [n for n, _ in merged], [[st[t] for _, st in merged] for t in range(len(strides))]


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _supported(*tensors: torch.Tensor) -> bool:
    return all((t.is_cuda or _INTERPRET) and t.dtype in _DTYPES for t in tensors)


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [{x.shape[-1]}] (the last dim of x), got {tuple(weight.shape)}")


def _launch(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float, mode: int,
            round_prod: bool, add: bool = False,
            pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, summed): ``gate`` is the gate of MODE _GATED, or with ``add`` the residual (then
    ``summed`` is the rounded x + residual; None otherwise)."""
    x = _last_dim_contiguous(x)
    gate = None if gate is None else _last_dim_contiguous(gate)
    tensors = [x] if gate is None else [x, gate]
    layout = _merged_rows(tuple(x.shape), *(t.stride() for t in tensors))
    if layout is None:  # too many unmergeable leading dims: index a contiguous copy instead
        tensors = [t.contiguous() for t in tensors]
        layout = _merged_rows(tuple(x.shape), *(t.stride() for t in tensors))
    sizes, strides = layout
    x = tensors[0]
    g, g_strides = (tensors[1], strides[1]) if gate is not None else (x, strides[0])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if add else None
    h = x.shape[-1]
    if out.numel() == 0:
        return out, summed
    n_rows = out.numel() // h
    bh = min(triton.next_power_of_2(h), _MAX_BLOCK_H)
    br = max(1, min(_TILE // bh, triton.next_power_of_2(n_rows)))
    num_warps = min(8, max(1, br * bh // 512))
    _norm_kernel[(triton.cdiv(n_rows, br),)](
        x, *strides[0], g, *g_strides, weight, weight.stride(0), out,
        out if summed is None else summed,  # never written without ADD
        n_rows, sizes[1], sizes[2], sizes[3], h, 1.0 / h, eps,
        MODE=mode, ROUND_PROD=round_prod, ADD=add, BR=br, BH=bh, CHUNKS=triton.cdiv(h, bh),
        num_warps=num_warps, enable_fp_fusion=False, **_pdl.launch_options(pdl, x.device))
    return out, summed


def rms_norm(*, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True,
             pdl: bool = False) -> torch.Tensor:
    """Triton version of :func:`common.ops.norm.reference.rms_norm` (same contract).

    ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` (``* weight`` when not zero_centered) in fp32,
    rounded once to x.dtype. CPU or fp64 tensors go to the reference. ``pdl``: launch as a
    programmatic dependent launch (``common/ops/pdl.py``); every op of this module takes it.
    """
    if not _supported(x, weight) or x.dim() == 0:
        return reference.rms_norm(x=x, weight=weight, eps=eps, zero_centered=zero_centered)
    _check_weight(x, weight)
    return _launch(x, None, weight, eps, _ZERO_CENTERED if zero_centered else _PLAIN, False,
                   pdl=pdl)[0]


def add_rms_norm(*, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = True, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`common.ops.norm.reference.add_rms_norm` (same contract).

    One launch reads x and the residual once and writes both ``summed`` (x + residual rounded to
    x.dtype) and ``normed`` (rms_norm of that rounded sum). Either input may have its own
    last-dim-contiguous strides. CPU or fp64 tensors go to the reference.
    """
    if not _supported(x, residual, weight) or x.dim() == 0 or residual.dtype != x.dtype:
        return reference.add_rms_norm(x=x, residual=residual, weight=weight, eps=eps,
                                      zero_centered=zero_centered)
    _check_weight(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
                         f"got {tuple(residual.shape)}, {residual.dtype}")
    normed, summed = _launch(x, residual, weight, eps, _ZERO_CENTERED if zero_centered else _PLAIN,
                             False, add=True, pdl=pdl)
    return normed, summed


def gated_rms_norm(*, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float, pdl: bool = False) -> torch.Tensor:
    """Triton version of :func:`common.ops.norm.reference.gated_rms_norm` (same contract).

    The normalised value is rounded to x.dtype before the weight multiply, and ``silu(gate)`` is
    applied in fp32, as the reference does. ``gate`` may have its own (last-dim contiguous)
    strides. CPU or fp64 tensors go to the reference.
    """
    if not _supported(x, gate, weight) or x.dim() == 0:
        return reference.gated_rms_norm(x=x, gate=gate, weight=weight, eps=eps)
    _check_weight(x, weight)
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}")
    round_prod = torch.promote_types(weight.dtype, x.dtype) == x.dtype
    return _launch(x, gate, weight, eps, _GATED, round_prod, pdl=pdl)[0]
