"""Gated DeltaNet kernels (gates, chunked prefill, token recurrence)."""

from common.ops.gdn.reference import (
    chunk_gated_delta_rule,
    gdn_decode_in_place,
    gdn_gating,
    recurrent_gated_delta_rule,
)

__all__ = ["gdn_gating", "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gdn_decode_in_place"]
