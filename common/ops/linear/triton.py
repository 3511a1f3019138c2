"""Triton projections for a few rows (decode steps, small verify blocks): weight-streaming GEMVs.

Same contract as :func:`common.ops.linear.reference.linear`. A decode step of a dense model is
mostly M = 1..16 projections whose cost is reading the weight once, so the kernel's one job is to
keep HBM busy: each program streams ``BLOCK_N`` whole weight rows (contiguous ``BLOCK_K`` chunks,
marked evict-first since no other program reads them) and keeps the few input rows in L1/L2.
cuBLAS picks split-K GEMM kernels at these shapes (and a separate reduce launch) that reached
63-84% of the copy bandwidth on the H200 (docs/performance.md); there is no library GEMV for
arbitrary M here, so it is written by hand, as torch inductor generates for M = 1.

Two kernels:

- ``_gemv_kernel`` (M <= 4): products accumulated per lane in fp32 over the whole K sweep and
  reduced once at the end (no cross-lane shuffle per chunk).
- ``_dot_kernel`` (M <= 16): a ``tl.dot`` tile of 16 padded rows, for verify blocks.

Shapes where cuBLAS measured faster (:func:`uses_triton`), rows above :data:`MAX_ROWS`, CPU
tensors and dtypes other than fp16/bf16/fp32 go to the reference (cuBLAS). Accumulation is fp32 and the output is rounded once, as cuBLAS does; the sum
order differs from cuBLAS's, so results agree to fp32 rounding of the dot products, not bit for
bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.ops.linear import reference
from common.ops.mlp.triton import silu_and_mul
from common.ops.triton_math import INTERPRET as _INTERPRET, exp as _exp, rsqrt as _rsqrt

__all__ = ["linear", "linear_swiglu", "norm_linear", "GemvConfig", "config_for", "uses_triton", "MAX_ROWS"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROWS = 16  # more rows than this and the GEMM is no longer bound by reading the weight once
_GEMV_ROWS = 4  # up to this many rows the in-lane kernel; above, the tensor-core tile
_WIDE = 12288  # weight rows from which the 16-row tile beats cuBLAS


@dataclass(frozen=True)
class GemvConfig:
    """Tile of one program: ``block_n`` weight rows, swept ``block_k`` columns at a time."""

    block_n: int
    block_k: int
    num_warps: int = 4


@triton.jit
def _load_input(x_rows, r_rows, ks, k_ok, EVEN_K: tl.constexpr, ADD: tl.constexpr,
                ty: tl.constexpr):
    """Input columns ``ks`` of the rows in fp32: x, or with ADD the sum x + residual rounded to
    the dtype (torch's add)."""
    if EVEN_K:
        v = tl.load(x_rows + ks[None, :]).to(tl.float32)
    else:
        v = tl.load(x_rows + ks[None, :], mask=k_ok, other=0.0).to(tl.float32)
    if ADD:
        if EVEN_K:
            r = tl.load(r_rows + ks[None, :]).to(tl.float32)
        else:
            r = tl.load(r_rows + ks[None, :], mask=k_ok, other=0.0).to(tl.float32)
        v = (v + r).to(ty).to(tl.float32)
    return v


@triton.jit
def _gemv_kernel(x, stride_xm, w, stride_wn, out, stride_om, M, N, K, up_offset,
                 res, stride_rm, norm_w, summed, inv_k, eps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
                 ADD: tl.constexpr):
    """out [M, N] = x [M, K] @ w[:N].T.

    SWIGLU: w is [2N, K] (gate rows, then up rows) and out = silu(x @ w[:N].T) * (x @ w[N:].T);
    each program reads its gate rows and the matching up rows, so the activation costs no pass.
    NORM: the input is the zero-centred RMSNorm (weight ``norm_w``) of x, or with ADD of
    x + res, whose sum program 0 stores to ``summed``. Every program first sweeps the input
    rows for their mean square (a few KB from L2), then normalises each chunk as it reads it.
    """
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    ty = out.dtype.element_ty
    w_rows = w + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * stride_wn
    m_safe = tl.where(m_ok, rm, 0).to(tl.int64)[:, None]
    x_rows = x + m_safe * stride_xm
    r_rows = res + m_safe * stride_rm
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    if NORM:
        sum_sq = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            k_ok = (ks < K)[None, :]
            h = _load_input(x_rows, r_rows, ks, k_ok, EVEN_K, ADD, ty)
            if ADD:  # one program writes the new residual stream
                tl.store(summed + rm[:, None] * K + ks[None, :], h.to(ty),
                         mask=m_ok[:, None] & k_ok & ((rk * 0 + pid) == 0)[None, :])
            sum_sq += h * h
        rstd = _rsqrt(tl.sum(sum_sq, axis=1) * inv_k + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)  # (unused without SWIGLU)
    up_rows = w_rows + up_offset
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_ok = (ks < K)[None, :]
        xt = _load_input(x_rows, r_rows, ks, k_ok, EVEN_K, ADD and NORM, ty)
        if NORM:  # as the Triton RMSNorm: (h * rstd) * (1 + w), rounded once
            if EVEN_K:
                nw = tl.load(norm_w + ks).to(tl.float32)
            else:
                nw = tl.load(norm_w + ks, mask=ks < K, other=0.0).to(tl.float32)
            xt = (xt * rstd[:, None] * (1.0 + nw)[None, :]).to(ty).to(tl.float32)
        xt = xt[:, None, :]
        if EVEN_K:
            wt = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
        else:
            wt = tl.load(w_rows + ks[None, :], mask=k_ok, other=0.0,
                         eviction_policy="evict_first")
        acc += xt * wt.to(tl.float32)[None, :, :]
        if SWIGLU:
            if EVEN_K:
                ut = tl.load(up_rows + ks[None, :], eviction_policy="evict_first")
            else:
                ut = tl.load(up_rows + ks[None, :], mask=k_ok, other=0.0,
                             eviction_policy="evict_first")
            acc_up += xt * ut.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    if SWIGLU:
        # the roundings of the two steps: each projection rounded to the dtype, silu in fp32
        # rounded, the product rounded (common.ops.mlp.triton.silu_and_mul)
        g = y.to(ty).to(tl.float32)
        u = tl.sum(acc_up, axis=2).to(ty).to(tl.float32)
        y = tl.math.div_rn(g, 1.0 + _exp(-g)).to(ty).to(tl.float32) * u
    tl.store(out + rm[:, None] * stride_om + rn[None, :], y.to(ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dot_kernel(x, stride_xm, w, stride_wn, out, stride_om, M, N, K, up_offset,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = w + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * stride_wn
    x_rows = x + tl.where(m_ok, rm, 0).to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        if EVEN_K:
            wt = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
            xt = tl.load(x_rows + ks[None, :], mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (ks < K)[None, :]
            wt = tl.load(w_rows + ks[None, :], mask=k_ok, other=0.0,
                         eviction_policy="evict_first")
            xt = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        if IEEE:
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
    tl.store(out + rm[:, None] * stride_om + rn[None, :], acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def uses_triton(rows: int, n: int) -> bool:
    """Whether the Triton kernel serves ``rows`` x [n, k]; cuBLAS does the rest.

    Measured on the H200 (``python -m benchmarks.linear --sweep``, Qwen3.5-4B shapes): one row
    is 2-30% faster than cuBLAS on every shape; 2-4 rows are slower (the per-lane accumulators
    grow with M); the 16-row tensor-core tile wins 3-7% on weights of 12k+ rows and loses up to
    2x on narrow ones, whose few programs cannot keep HBM busy without a split-K.
    """
    return rows == 1 or (_GEMV_ROWS < rows <= MAX_ROWS and n >= _WIDE)


def config_for(rows: int, n: int, k: int) -> GemvConfig:
    """The tile for ``rows`` x [n, k] (best of the sweep in benchmarks/linear.py on the H200)."""
    if rows > _GEMV_ROWS:
        return GemvConfig(block_n=64, block_k=128, num_warps=4)
    # narrow weights (the 2560-row out projections) need small tiles to give every SM several
    # programs; long rows are read in 2 KB chunks
    block_n = max(1, min(8, triton.next_power_of_2(n // 1024 + 1) // 2))
    block_k = 1024 if k >= 4096 else min(512, triton.next_power_of_2(k))
    block_n = max(1, min(block_n, 2048 // (block_k * triton.next_power_of_2(rows)) * 4))
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=4)


@dataclass(frozen=True)
class _PreNorm:
    """The pre-norm a GEMV applies to its input: norm weight, eps, the residual to add (or
    None) and where the sum goes."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None
    summed: torch.Tensor | None


def _launch(x2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: GemvConfig,
            swiglu: bool = False, norm: _PreNorm | None = None) -> None:
    m, k = x2.shape
    n = out.shape[1]
    # with swiglu the up rows start n rows below the gate rows
    args = (x2, x2.stride(0), weight, weight.stride(0), out, out.stride(0), m, n, k,
            n * weight.stride(0) if swiglu else 0)
    if m <= _GEMV_ROWS or swiglu or norm is not None:
        res = norm.residual if norm is not None and norm.residual is not None else x2
        _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            *args, res, res.stride(0), norm.weight if norm else x2,
            norm.summed if norm and norm.summed is not None else out, 1.0 / k,
            norm.eps if norm else 0.0,
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_K=k % cfg.block_k == 0, SWIGLU=swiglu, NORM=norm is not None,
            ADD=norm is not None and norm.residual is not None, num_warps=cfg.num_warps)
    else:
        block_n, block_k = max(16, cfg.block_n), max(16, cfg.block_k)  # tl.dot's minimum
        _dot_kernel[(triton.cdiv(n, block_n),)](
            *args, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            IEEE=x2.dtype == torch.float32, num_warps=cfg.num_warps)


def linear(*, x: torch.Tensor, weight: torch.Tensor,
           config: GemvConfig | None = None) -> torch.Tensor:
    """Triton version of :func:`common.ops.linear.reference.linear` (same contract).

    Shapes :func:`uses_triton` turns down go to cuBLAS.

    Args:
        config: a tile to use instead of :func:`config_for`'s, for any row count up to
            :data:`MAX_ROWS` (benchmarks sweep it; tests force both kernels with it).
    """
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if (not (x.is_cuda or _INTERPRET) or x.dtype not in _DTYPES or weight.dtype != x.dtype
            or weight.dim() != 2 or x.shape[-1] != weight.shape[1] or not 0 < rows <= MAX_ROWS
            or weight.stride(1) != 1
            or (config is None and not uses_triton(rows, weight.shape[0]))):
        return reference.linear(x=x, weight=weight)  # (which raises for mismatched shapes)
    n, k = weight.shape
    x2 = x.reshape(rows, k)  # a view whenever the leading strides allow
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _launch(x2, weight, out, config or config_for(rows, n, k))
    return out.view(*x.shape[:-1], n)


def linear_swiglu(*, x: torch.Tensor, weight: torch.Tensor,
                  config: GemvConfig | None = None) -> torch.Tensor:
    """Triton version of :func:`common.ops.linear.reference.linear_swiglu` (same contract).

    One row (a batch-1 decode step's MLP): one GEMV launch whose epilogue applies the
    activation. More rows: :func:`linear` then the Triton ``silu_and_mul`` (two launches).
    """
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if (not (x.is_cuda or _INTERPRET) or x.dtype not in _DTYPES or weight.dtype != x.dtype
            or weight.dim() != 2 or weight.shape[0] % 2 or x.shape[-1] != weight.shape[1]
            or weight.stride(1) != 1):
        return reference.linear_swiglu(x=x, weight=weight)  # (which raises for bad shapes)
    if rows != 1 and config is None:
        return silu_and_mul(x=linear(x=x, weight=weight))
    if not 0 < rows <= _GEMV_ROWS:
        raise ValueError(f"a tile serves at most {_GEMV_ROWS} rows here, got {rows}")
    inter, k = weight.shape[0] // 2, weight.shape[1]
    x2 = x.reshape(rows, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    # the tile of one weight half: two row blocks per program
    _launch(x2, weight, out, config or config_for(rows, inter, k), swiglu=True)
    return out.view(*x.shape[:-1], inter)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def norm_linear(*, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, swiglu: bool = False,
                config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`common.ops.linear.reference.norm_linear` (same contract).

    One row (a batch-1 decode step): one GEMV launch that adds the residual, normalises and
    projects (and with ``swiglu`` applies the activation), instead of a norm launch and a GEMV.
    More rows: the Triton residual add + RMSNorm, then :func:`linear` or :func:`linear_swiglu`.
    """
    rows = _rows(x)
    shapes_ok = (x.dim() and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
                 and norm_weight.shape == (x.shape[-1],)
                 and (residual is None or (residual.shape == x.shape
                                           and residual.dtype == x.dtype))
                 and not (swiglu and weight.shape[0] % 2))
    if (not (x.is_cuda or _INTERPRET) or x.dtype not in _DTYPES or weight.dtype != x.dtype
            or not shapes_ok or weight.stride(1) != 1):
        return reference.norm_linear(x=x, residual=residual, norm_weight=norm_weight, eps=eps,
                                     weight=weight, swiglu=swiglu)  # (raises for bad shapes)
    if rows != 1 and config is None:
        from common.ops.norm.triton import add_rms_norm, rms_norm

        if residual is None:
            normed, summed = rms_norm(x=x, weight=norm_weight, eps=eps, zero_centered=True), x
        else:
            normed, summed = add_rms_norm(x=x, residual=residual, weight=norm_weight, eps=eps,
                                          zero_centered=True)
        project = linear_swiglu if swiglu else linear
        return project(x=normed, weight=weight), summed
    if not 0 < rows <= _GEMV_ROWS:
        raise ValueError(f"a tile serves at most {_GEMV_ROWS} rows here, got {rows}")
    k = weight.shape[1]
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    x2 = x.reshape(rows, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    res2 = None
    if residual is not None:
        res2 = residual.reshape(rows, k)
        if res2.stride(1) != 1:
            res2 = res2.contiguous()
    summed = torch.empty(rows, k, dtype=x.dtype, device=x.device) if residual is not None else None
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _launch(x2, weight, out, config or config_for(rows, n, k), swiglu=swiglu,
            norm=_PreNorm(norm_weight, eps, res2, summed))
    new_residual = x if summed is None else summed.view(x.shape)
    return out.view(*x.shape[:-1], n), new_residual
