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

