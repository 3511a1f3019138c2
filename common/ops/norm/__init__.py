"""RMSNorm variants and l2norm."""

from common.ops.norm.reference import gated_rms_norm, l2norm, rms_norm

__all__ = ["rms_norm", "gated_rms_norm", "l2norm"]
