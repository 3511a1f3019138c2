"""Triton sigmoid output gate ``x * sigmoid(gate)`` of a full-attention layer, in one launch.

Same contract as :func:`common.ops.attention.output_gate_reference.sigmoid_gate_mul`. torch takes
two kernels for the expression (sigmoid, then the product) and rounds between them; this one
rounds at the same places: ``1 / (1 + exp(-gate))`` in fp32 with libdevice's exp (the function
torch's CUDA sigmoid calls) and an IEEE division, rounded to the dtype, then the product in fp32,
rounded. bf16 / fp16 / fp32 results are therefore meant to agree with torch bit for bit.

x and gate ``[T, H, D]`` may be strided views with contiguous last dims (e.g. the gate half of
each head of the q|gate projection); the output is a new contiguous ``[T, H * D]``. Grid: one
program per (token, block of heads); nothing syncs with the host (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.ops import pdl as _pdl
from common.ops.attention import output_gate_reference as reference
from common.ops.triton_math import INTERPRET as _INTERPRET, exp as _exp

__all__ = ["sigmoid_gate_mul"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 1024  # elements per program of a large grid
_LATENCY_GRID = 512  # (token, head) pairs up to which a launch is latency bound


@triton.jit
def _gate_kernel(x, sxt, sxh, g, sgt, sgh, o, H, D, BHEADS: tl.constexpr, BD: tl.constexpr,
                 PDL: tl.constexpr):
    _pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = (tl.program_id(1) * BHEADS + tl.arange(0, BHEADS)).to(tl.int64)
    d = tl.arange(0, BD)
    mask = (heads < H)[:, None] & (d < D)[None, :]
    xv = tl.load(x + t * sxt + heads[:, None] * sxh + d[None, :], mask=mask, other=0.0)
    gv = tl.load(g + t * sgt + heads[:, None] * sgh + d[None, :], mask=mask, other=0.0)
    ty = o.dtype.element_ty
    gv = gv.to(tl.float32)
    sig = tl.math.div_rn(1.0, 1.0 + _exp(-gv)).to(ty).to(tl.float32)  # torch.sigmoid's result
    y = xv.to(tl.float32) * sig
    tl.store(o + (t * H + heads[:, None]) * D + d[None, :], y.to(ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _supported(x: torch.Tensor, gate: torch.Tensor) -> bool:
    return all((t.is_cuda or _INTERPRET) and t.device == x.device and t.dtype in _DTYPES
               for t in (x, gate))


def _launch(*, x: torch.Tensor, gate: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """The kernel launch on arguments already checked and supported (CPU tensors allowed under
    ``TRITON_INTERPRET=1``)."""
    x, gate = _last_dim_contiguous(x), _last_dim_contiguous(gate)
    t, h, d = x.shape
    out = torch.empty(t, h * d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    bd = triton.next_power_of_2(d)
    # a decode-sized grid is latency bound: one head per program spreads it over more SMs (H200,
    # T=1, 16 x 256: 1.3 us against 1.5 with four heads); a large one wants fewer, fuller programs
    tile = bd if t * h <= _LATENCY_GRID else _TILE
    bheads = max(1, min(triton.next_power_of_2(h), tile // bd))
    _gate_kernel[(t, triton.cdiv(h, bheads))](
        x, x.stride(0), x.stride(1), gate, gate.stride(0), gate.stride(1), out, h, d,
        BHEADS=bheads, BD=bd, num_warps=max(1, min(4, bheads * bd // 64)), enable_fp_fusion=False,
        **_pdl.launch_options(pdl, x.device))
    return out


def sigmoid_gate_mul(*, x: torch.Tensor, gate: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """Triton version of :func:`common.ops.attention.output_gate_reference.sigmoid_gate_mul` (same
    contract): ``x * torch.sigmoid(gate)`` as a new contiguous [T, H * D] tensor in x.dtype.

    CPU tensors, fp64, or tensors on different devices go to the reference. ``pdl``: launch as
    a programmatic dependent launch (``common/ops/pdl.py``).
    """
    reference.check_gate_args(x, gate)
    if not _supported(x, gate):
        return reference.sigmoid_gate_mul(x=x, gate=gate)
    return _launch(x=x, gate=gate, pdl=pdl)
