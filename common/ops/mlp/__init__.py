"""SwiGLU MLP and its activation."""

from common.ops.mlp.reference import silu_and_mul, silu_glu_mlp

__all__ = ["silu_glu_mlp", "silu_and_mul"]
