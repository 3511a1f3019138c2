"""Sparse mixture-of-experts block."""

from common.ops.moe.reference import sparse_moe

__all__ = ["sparse_moe"]
