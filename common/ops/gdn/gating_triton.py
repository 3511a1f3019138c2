"""Triton GDN gates: ``g`` and ``beta`` of every token and value head in one launch.

Same contract as :func:`common.ops.gdn.reference.gdn_gating`. Every input is widened to fp32 and
the formulas are torch's own: ``softplus(x) = x if x > 20 else log1p(exp(x))`` (F.softplus with
threshold 20; below the threshold exp cannot overflow and log1p keeps the tiny values of very
negative x), ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = 1 / (1 + exp(-b))`` with an
IEEE division. On the GPU exp and log1p are libdevice's, the functions torch's CUDA kernels call,
and FMA contraction is off, so the results match the reference to the last bit or nearly so.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from common.ops.gdn import reference
from common.ops.triton_math import INTERPRET as _INTERPRET, exp as _exp, log1p as _log1p

__all__ = ["gdn_gating"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 1024  # elements per program
_SOFTPLUS_THRESHOLD = 20.0  # F.softplus's default: above it softplus(x) is x


@triton.jit
def _gating_kernel(
    A_log, stride_A, a, stride_at, dt_bias, stride_dt, b, stride_bt, g, beta, T, HV,
    THRESHOLD: tl.constexpr, BT: tl.constexpr, BHV: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    heads = tl.program_id(1) * BHV + tl.arange(0, BHV)
    mask_h = heads < HV
    mask = (rows < T)[:, None] & mask_h[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    av = tl.load(a + rows64 * stride_at + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    bv = tl.load(b + rows64 * stride_bt + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    alog = tl.load(A_log + heads * stride_A, mask=mask_h, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias + heads * stride_dt, mask=mask_h, other=0.0).to(tl.float32)
    x = av + bias[None, :]
    # the masked exp only runs where x <= THRESHOLD, so it never overflows
    sp = tl.where(x > THRESHOLD, x, _log1p(_exp(tl.minimum(x, THRESHOLD))))
    gv = -_exp(alog)[None, :] * sp
    bt = tl.math.div_rn(1.0, 1.0 + _exp(-bv))
    out = rows64 * HV + heads[None, :]
    tl.store(g + out, gv, mask=mask)
    tl.store(beta + out, bt, mask=mask)


def _supported(*tensors: torch.Tensor) -> bool:
    return all((t.is_cuda or _INTERPRET) and t.dtype in _DTYPES for t in tensors)


def _rows_strided(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is contiguous (rows may be strided), else a contiguous copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def gdn_gating(
    *, A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`common.ops.gdn.reference.gdn_gating` (same contract).

    Args:
        A_log: [HV]. a: [T, HV] (rows may be strided). dt_bias: [HV]. b: [T, HV].

    Returns:
        g ``-exp(A_log) * softplus(a + dt_bias)`` and beta ``sigmoid(b)``, both [T, HV] fp32.
        CPU or fp64 inputs go to the reference (which returns fp64 for fp64 inputs).
    """
    if not _supported(A_log, a, dt_bias, b):
        return reference.gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    if a.dim() != 2 or b.shape != a.shape:
        raise ValueError(f"a and b must both be [T, HV], got {tuple(a.shape)} and {tuple(b.shape)}")
    t, hv = a.shape
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(
            f"A_log and dt_bias must be [{hv}], got {tuple(A_log.shape)} and {tuple(dt_bias.shape)}"
        )
    a, b = _rows_strided(a), _rows_strided(b)
    g = torch.empty(t, hv, dtype=torch.float32, device=a.device)
    beta = torch.empty(t, hv, dtype=torch.float32, device=a.device)
    if g.numel() == 0:
        return g, beta
    bhv = min(triton.next_power_of_2(hv), _TILE)
    bt = max(1, min(_TILE // bhv, triton.next_power_of_2(t)))
    grid = (triton.cdiv(t, bt), triton.cdiv(hv, bhv))
    _gating_kernel[grid](
        A_log, A_log.stride(0), a, a.stride(0), dt_bias, dt_bias.stride(0), b, b.stride(0), g, beta,
        t, hv, THRESHOLD=_SOFTPLUS_THRESHOLD, BT=bt, BHV=bhv,
        num_warps=4 if bt * bhv >= 512 else 1, enable_fp_fusion=False)
    return g, beta
