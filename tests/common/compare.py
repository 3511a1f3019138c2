"""Error measures and the element-wise closeness rule shared by the GPU kernel tests."""

from __future__ import annotations

import torch


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values drawn in fp32 on ``gen``'s device, then rounded to ``dtype``."""
    return torch.randn(*shape, generator=gen, device=gen.device).to(dtype)


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, record, name: str, *,
                       ulps: int = 1, beyond_one_ulp: float = 0.0) -> None:
    """A fused kernel's contiguous output against its reference, of the same shape and dtype:
    fp32 within 1e-5 relative (+1e-6); otherwise within ``ulps`` bf16 ulps of the value, with
    at most a ``beyond_one_ulp`` fraction of the elements past one ulp. Records the largest
    difference and the fraction of unequal elements."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert got.is_contiguous(), name
    diff = (got.float() - want.float()).abs()
    record(f"{name}.max_abs", diff.max().item())
    record(f"{name}.unequal", (got != want).float().mean().item())
    if got.dtype == torch.float32:
        assert bool((diff <= want.abs() * 1e-5 + 1e-6).all()), name
        return
    one_ulp = want.float().abs() * 2**-7 + 1e-6  # one bf16 ulp of the value (8 mantissa bits)
    assert bool((diff <= one_ulp * ulps).all()), name
    assert (diff > one_ulp).float().mean().item() <= beyond_one_ulp, name
