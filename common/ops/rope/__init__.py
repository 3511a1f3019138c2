"""Partial NeoX rotary position embedding."""

from common.ops.rope.reference import apply_rope, rope_inv_freq

__all__ = ["rope_inv_freq", "apply_rope"]
