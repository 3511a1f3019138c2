"""Plain-torch projection: the definition the GPU GEMV is compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.ops.mlp.reference import silu_and_mul
from common.ops.norm.reference import add_rms_norm, rms_norm

__all__ = ["linear", "linear_swiglu", "norm_linear"]


def linear(*, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in x's dtype (fp32 accumulation inside the GEMM, as nn.Linear does).

    Args:
        x: [..., K]; rows may be strided (a column view of a wider projection).
        weight: [N, K], the nn.Linear layout.

    Returns:
        [..., N], a new tensor in x.dtype.
    """
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] must agree on K, got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    return F.linear(x, weight)


def linear_swiglu(*, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gate/up projection and its SwiGLU activation: ``silu(x @ Wg.T) * (x @ Wu.T)`` with
    ``weight = [Wg; Wu]`` ([2I, K], gate rows first), rounded as the two steps round.

    Returns:
        [..., I], a new tensor in x.dtype.
    """
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"weight must be [2I, K] (gate rows, then up rows), got "
                         f"{tuple(weight.shape)}")
    return silu_and_mul(x=linear(x=x, weight=weight))


def norm_linear(*, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor,
                swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's pre-norm and the projection that reads it: ``h = x + residual`` (``x``
    when residual is None), the zero-centred RMSNorm of ``h``, then :func:`linear` (or, with
    ``swiglu``, :func:`linear_swiglu`) of the normalised rows. Rounded as the steps round.

    Args:
        x, residual: [..., K] in one dtype; residual None for the first layer.
        norm_weight: [K], the norm's ``w`` of a ``1 + w`` scale.
        weight: [N, K] (or [2I, K] with swiglu).

    Returns:
        (y [..., N] (or [..., I]), h): the projection and the new residual stream.
    """
    if residual is None:
        normed, summed = rms_norm(x=x, weight=norm_weight, eps=eps, zero_centered=True), x
    else:
        normed, summed = add_rms_norm(x=x, residual=residual, weight=norm_weight, eps=eps,
                                      zero_centered=True)
    project = linear_swiglu if swiglu else linear
    return project(x=normed, weight=weight), summed
