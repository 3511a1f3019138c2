"""Plain-torch sigmoid output gate of a full-attention layer: ``o * sigmoid(gate)``."""

from __future__ import annotations

import torch

__all__ = ["sigmoid_gate_mul", "check_gate_args"]


def check_gate_args(x: torch.Tensor, gate: torch.Tensor) -> None:
    """ValueError unless x is [T, H, D] and gate has its shape and dtype."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, D], got {tuple(x.shape)}")
    if gate.shape != x.shape or gate.dtype != x.dtype:
        raise ValueError(f"gate must match x ({tuple(x.shape)}, {x.dtype}), "
                         f"got {tuple(gate.shape)}, {gate.dtype}")


def sigmoid_gate_mul(*, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * torch.sigmoid(gate)`` flattened to [T, H * D], with that expression's roundings.

    For bf16 / fp16, torch computes ``1 / (1 + exp(-gate))`` in fp32 and rounds it to the dtype,
    then multiplies in fp32 and rounds again; this is that expression, not a fused fp32 one.

    Args:
        x: [T, H, D] attention output.
        gate: [T, H, D] of x's dtype, e.g. the gate half of each head of the q|gate projection.

    Returns:
        A new contiguous [T, H * D] tensor in x.dtype.
    """
    check_gate_args(x, gate)
    t, h, d = x.shape
    return (x * torch.sigmoid(gate)).reshape(t, h * d).contiguous()
