"""Bias-free projections ``x @ weight.T`` (every dense weight of the model goes through one), and
the gate/up projection fused with its SwiGLU activation, and either fused with the pre-norm before
it."""

from common.ops.linear.reference import linear, linear_swiglu, norm_linear

__all__ = ["linear", "linear_swiglu", "norm_linear"]
