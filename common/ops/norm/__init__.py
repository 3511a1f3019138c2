"""RMSNorm variants (plain, after a residual add, gated) and l2norm."""

from common.ops.norm.reference import add_rms_norm, gated_rms_norm, l2norm, rms_norm

__all__ = ["rms_norm", "add_rms_norm", "gated_rms_norm", "l2norm"]
