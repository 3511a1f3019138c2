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
tensors and dtypes other than fp16/bf16/fp32 go to the reference (cuBLAS). Accumulation is fp32
and the output is rounded once, as cuBLAS does; the sum order differs from cuBLAS's, so results
agree to fp32 rounding of the dot products, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.ops import pdl as _pdl
from common.ops.linear import reference
from common.ops.triton_math import INTERPRET as _INTERPRET

__all__ = ["linear", "GemvConfig", "config_for", "uses_triton", "MAX_ROWS"]

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
def _load_chunk(rows, ks, K, EVEN_K: tl.constexpr, WEIGHT: tl.constexpr):
    """Columns ``ks`` of the rows (0 past K); weights are read once: evict them first."""
    if EVEN_K:
        if WEIGHT:
            v = tl.load(rows + ks[None, :], eviction_policy="evict_first")
        else:
            v = tl.load(rows + ks[None, :])
    else:
        if WEIGHT:
            v = tl.load(rows + ks[None, :], mask=(ks < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        else:
            v = tl.load(rows + ks[None, :], mask=(ks < K)[None, :], other=0.0)
    return v


@triton.jit
def _tile(x, stride_xm, w, stride_wn, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """This program's output rows and columns, their masks, the row pointers of its weight rows
    and input rows (out-of-range rows point at row 0), and the column offsets of one chunk."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = w + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * stride_wn
    x_rows = x + tl.where(m_ok, rm, 0).to(tl.int64)[:, None] * stride_xm
    return rn, rm, n_ok, m_ok, w_rows, x_rows, tl.arange(0, BLOCK_K)


@triton.jit
def _gemv_kernel(x, stride_xm, w, stride_wn, out, stride_om, M, N, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PDL: tl.constexpr):
    rn, rm, n_ok, m_ok, w_rows, x_rows, rk = _tile(x, stride_xm, w, stride_wn, M, N, BLOCK_M,
                                                   BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    k_start = 0
    if PDL:
        # the weights depend on no earlier kernel: the first chunk is read while the kernel
        # before this one finishes, then the input row once it has
        _pdl.trigger(PDL)
        wt = _load_chunk(w_rows, rk, K, EVEN_K, True)
        _pdl.wait(PDL)
        xt = _load_chunk(x_rows, rk, K, EVEN_K, False)
        acc += xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        ks = k0 + rk
        wt = _load_chunk(w_rows, ks, K, EVEN_K, True)
        xt = _load_chunk(x_rows, ks, K, EVEN_K, False)
        acc += xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    tl.store(out + rm[:, None] * stride_om + rn[None, :], y.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dot_kernel(x, stride_xm, w, stride_wn, out, stride_om, M, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    _pdl.start(PDL)
    rn, rm, n_ok, m_ok, w_rows, x_rows, rk = _tile(x, stride_xm, w, stride_wn, M, N, BLOCK_M,
                                                   BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        wt = _load_chunk(w_rows, ks, K, EVEN_K, True)
        # padded rows are zeroed here (the tile always has 16), unlike the GEMV's clamped rows
        if EVEN_K:
            xt = tl.load(x_rows + ks[None, :], mask=m_ok[:, None], other=0.0)
        else:
            xt = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
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


def _launch(x2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: GemvConfig,
            pdl: bool) -> None:
    m, k = x2.shape
    n = out.shape[1]
    args = (x2, x2.stride(0), weight, weight.stride(0), out, out.stride(0), m, n, k)
    options = _pdl.launch_options(pdl, x2.device)
    if m <= _GEMV_ROWS:
        _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            *args, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, **options)
    else:
        block_n, block_k = max(16, cfg.block_n), max(16, cfg.block_k)  # tl.dot's minimum
        _dot_kernel[(triton.cdiv(n, block_n),)](
            *args, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            IEEE=x2.dtype == torch.float32, num_warps=cfg.num_warps, **options)


def linear(*, x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
           pdl: bool = False) -> torch.Tensor:
    """Triton version of :func:`common.ops.linear.reference.linear` (same contract).

    Shapes :func:`uses_triton` turns down go to cuBLAS.

    Args:
        config: a tile to use instead of :func:`config_for`'s, for any row count up to
            :data:`MAX_ROWS` (benchmarks sweep it; tests force both kernels with it).
        pdl: launch as a programmatic dependent launch (``common/ops/pdl.py``): the GEMV reads
            its first weight chunk before the kernel ahead of it has finished, so that kernel
            must not be the one that wrote the weight. cuBLAS shapes launch as usual.
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
    _launch(x2, weight, out, config or config_for(rows, n, k), pdl)
    return out.view(*x.shape[:-1], n)

