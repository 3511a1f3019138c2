"""Short causal depthwise conv1d of the GDN layers."""

from common.ops.conv1d.reference import causal_conv1d_prefill, causal_conv1d_update, conv1d_update_in_place

__all__ = ["causal_conv1d_prefill", "causal_conv1d_update", "conv1d_update_in_place"]
