"""Plain-torch projection: the definition the GPU GEMV is compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear"]


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

