"""Plain-torch RMSNorm variants of Qwen3.5 / Qwen3-Next, and the l2norm used on GDN q/k."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "add_rms_norm", "gated_rms_norm", "l2norm"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [{x.shape[-1]}] (the last dim of x), got {tuple(weight.shape)}")


def rms_norm(*, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim, as Qwen3NextRMSNorm / Qwen3_5RMSNorm.

    ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` (``* weight`` when not zero_centered), computed in
    fp32 and rounded once at the end (the weight multiply happens before the downcast, unlike Llama).

    Args:
        x: [..., H].
        weight: [H].
        eps: added to the mean square.
        zero_centered: the checkpoint stores ``w`` for a scale of ``1 + w``.

    Returns:
        [..., H] in x.dtype.
    """
    _check_weight(x, weight)
    dt = _compute_dtype(x)
    h = x.to(dt)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(dt)
    h = h * (1.0 + w) if zero_centered else h * w
    return h.to(x.dtype)


def add_rms_norm(*, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add followed by :func:`rms_norm` of the sum (a decoder layer's pre-norm).

    ``summed = x + residual`` is torch's add of two x.dtype tensors (computed in fp32 for bf16/fp16
    and rounded once to x.dtype); ``normed`` is ``rms_norm`` of that rounded sum, so the pair is
    exactly what the unfused model computes.

    Args:
        x: [..., H].
        residual: x's shape and dtype.
        weight: [H].
        eps: added to the mean square.
        zero_centered: the checkpoint stores ``w`` for a scale of ``1 + w``.

    Returns:
        (normed, summed), both new [..., H] tensors in x.dtype.
    """
    _check_residual(x, residual)
    summed = x + residual
    return rms_norm(x=summed, weight=weight, eps=eps, zero_centered=zero_centered), summed


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
                         f"got {tuple(residual.shape)}, {residual.dtype}")


def gated_rms_norm(*, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm-before-gate RMSNorm of the GDN output, as Qwen3NextRMSNormGated.

    The normalised value is rounded to x.dtype *before* the (plain, not 1+w) weight multiply and the
    ``silu(gate)`` gate is applied in fp32; those roundings are transformers' and are kept.

    Args:
        x: [..., dv] attention output per value head.
        gate: [..., dv] the z projection.
        weight: [dv].
        eps: added to the mean square.

    Returns:
        [..., dv] in x.dtype.
    """
    _check_weight(x, weight)
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}")
    dt = _compute_dtype(x)
    h = x.to(dt)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    h = h * F.silu(gate.to(dt))
    return h.to(x.dtype)


def l2norm(*, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (transformers' / fla's l2norm), in fp32.

    Args:
        x: [..., K].
        eps: added to the sum of squares (not to the norm).

    Returns:
        [..., K] in x.dtype.
    """
    h = x.to(_compute_dtype(x))
    return (h * torch.rsqrt((h * h).sum(-1, keepdim=True) + eps)).to(x.dtype)
