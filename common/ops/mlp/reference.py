"""Plain-torch SwiGLU MLP (dense layers and the MoE shared expert) and its activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["silu_glu_mlp", "silu_and_mul"]


def silu_glu_mlp(
    *, x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` in x's dtype, as transformers computes it (GEMMs
    accumulate in fp32 inside; casting the weights up instead would rewrite every weight on
    every call).

    Args:
        x: [..., H].
        gate_proj, up_proj: [I, H] (nn.Linear layout).
        down_proj: [H, I].

    Returns:
        [..., H] in x.dtype.
    """
    hidden = x.shape[-1]
    if gate_proj.dim() != 2 or gate_proj.shape[1] != hidden or up_proj.shape != gate_proj.shape:
        raise ValueError(
            f"gate_proj and up_proj must both be [I, {hidden}], got {tuple(gate_proj.shape)} and {tuple(up_proj.shape)}"
        )
    if down_proj.shape != (hidden, gate_proj.shape[0]):
        raise ValueError(f"down_proj must be [{hidden}, {gate_proj.shape[0]}], got {tuple(down_proj.shape)}")
    act = F.silu(F.linear(x, gate_proj.to(x.dtype))) * F.linear(x, up_proj.to(x.dtype))
    return F.linear(act, down_proj.to(x.dtype))


def silu_and_mul(*, x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU activation of a fused gate/up projection: ``silu(x[..., :I]) * x[..., I:]``.

    Torch's roundings for x.dtype: silu is computed in fp32 and rounded to x.dtype, then the
    product of the two x.dtype halves is rounded (the activation of :func:`silu_glu_mlp`).

    Args:
        x: [..., 2I], the gate half first.

    Returns:
        [..., I] in x.dtype (a new tensor).
    """
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2I] (gate then up), got {tuple(x.shape)}")
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]
