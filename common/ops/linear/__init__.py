"""Bias-free projections ``x @ weight.T`` (every dense weight of the model goes through one)."""

from common.ops.linear.reference import linear

__all__ = ["linear"]
