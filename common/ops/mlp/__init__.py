"""SwiGLU MLP."""

from common.ops.mlp.reference import silu_glu_mlp

__all__ = ["silu_glu_mlp"]
