"""Causal attention over the paged KV cache."""

from common.ops.attention.reference import paged_attention

__all__ = ["paged_attention"]
