"""The reference projection: nn.Linear's arithmetic and its shape errors."""

from __future__ import annotations

import pytest
import torch

from common.ops.linear.reference import linear


def test_matches_nn_linear_on_strided_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 40, generator=gen)[:, 1, 3:33]
    w = torch.randn(7, 30, generator=gen)
    torch.testing.assert_close(linear(x=x, weight=w), x @ w.T)


def test_mismatched_k_raises():
    with pytest.raises(ValueError, match="agree on K"):
        linear(x=torch.zeros(2, 5), weight=torch.zeros(3, 4))


def test_linear_swiglu_is_the_activation_of_the_projection():
    from common.ops.linear.reference import linear_swiglu

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, generator=gen)
    w = torch.randn(10, 16, generator=gen)
    gate, up = (x @ w.T).split(5, dim=-1)
    torch.testing.assert_close(linear_swiglu(x=x, weight=w), torch.nn.functional.silu(gate) * up)
    with pytest.raises(ValueError, match="gate rows, then up rows"):
        linear_swiglu(x=x, weight=w[:9])
