"""Triton SwiGLU activation ``silu(gate) * up`` of a fused gate/up projection, in one launch.

Same contract as :func:`common.ops.mlp.reference.silu_and_mul`. The arithmetic is torch's: the
gate half widened to fp32, ``silu(g) = g / (1 + exp(-g))`` with IEEE division (torch's CUDA silu
kernel computes exactly that, with libdevice's exp), rounded to x.dtype, then the product with the
up half computed in fp32 and rounded to x.dtype. FMA contraction is off, so bf16 and fp32 results
can agree with the reference bit for bit.

``x`` is ``[..., 2I]`` with a contiguous last dim; leading dims that flatten to rows without a
copy (e.g. a ``[T, 2I]`` view with a row stride) are read in place. The output is a fresh
contiguous ``[..., I]``. Grid: one program per (row, block of columns), so even a one-token
decode step spreads an intermediate size of ~10k over several programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.ops import pdl as _pdl
from common.ops.mlp import reference
from common.ops.triton_math import INTERPRET as _INTERPRET, exp as _exp

__all__ = ["silu_and_mul"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(x, stride_x, out, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    src = x + row * stride_x
    ty = out.dtype.element_ty
    g = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + I + cols, mask=mask, other=0.0).to(tl.float32)
    # torch rounds silu's result to x.dtype before the multiply, and the product once more
    s = tl.math.div_rn(g, 1.0 + _exp(-g)).to(ty).to(tl.float32)
    tl.store(out + row * I + cols, (s * u).to(ty), mask=mask)


def silu_and_mul(*, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """Triton version of :func:`common.ops.mlp.reference.silu_and_mul` (same contract).

    ``silu(x[..., :I]) * x[..., I:]`` with torch's roundings for x.dtype, as a new contiguous
    ``[..., I]`` tensor. CPU or fp64 tensors go to the reference. ``pdl``: launch as a
    programmatic dependent launch (``common/ops/pdl.py``).
    """
    if not ((x.is_cuda or _INTERPRET) and x.dtype in _DTYPES) or x.dim() == 0 or x.shape[-1] % 2:
        return reference.silu_and_mul(x=x)  # (which raises for a last dim that is not 2I)
    i = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], i, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, x.shape[-1])  # a view whenever the leading strides allow
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = min(_BLOCK, triton.next_power_of_2(i))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(i, block))](
        rows, rows.stride(0), out, i, BLOCK=block, num_warps=max(1, min(4, block // 256)),
        enable_fp_fusion=False, **_pdl.launch_options(pdl, x.device))
    return out
