"""The set of kernel functions one model instance calls, chosen once when it is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from common.ops.registry import OpRegistry, default_registry

# Kernels field -> registry op name, for every op the model calls.
MODEL_OPS = {
    "rms_norm": "rms_norm",
    "add_rms_norm": "add_rms_norm",
    "gated_rms_norm": "gated_rms_norm",
    "conv1d_prefill": "causal_conv1d_prefill",
    "gdn_gating": "gdn_gating",
    "gdn_chunk": "chunk_gated_delta_rule",
    "gdn_verify": "gdn_verify",
    "gdn_decode_in_place": "gdn_decode_in_place",
    "conv1d_update_in_place": "conv1d_update_in_place",
    "gdn_commit_in_place": "gdn_commit_in_place",
    "rope": "apply_rope",
    "paged_attention": "paged_attention",
    "store_paged_kv": "store_paged_kv",
    "qk_norm_rope_store": "qk_norm_rope_store",
    "sigmoid_gate_mul": "sigmoid_gate_mul",
    "draft_attention": "draft_block_attention",
    "silu_and_mul": "silu_and_mul",
    "sparse_moe": "sparse_moe",
    "linear": "linear",
}


@dataclass(frozen=True)
class Kernels:
    """Resolved kernel callables; the model never looks a backend up at call time."""

    rms_norm: Callable
    add_rms_norm: Callable
    gated_rms_norm: Callable
    conv1d_prefill: Callable
    gdn_gating: Callable
    gdn_chunk: Callable
    gdn_verify: Callable
    gdn_decode_in_place: Callable
    conv1d_update_in_place: Callable
    gdn_commit_in_place: Callable
    rope: Callable
    paged_attention: Callable
    store_paged_kv: Callable
    qk_norm_rope_store: Callable
    sigmoid_gate_mul: Callable
    draft_attention: Callable
    silu_and_mul: Callable
    sparse_moe: Callable
    linear: Callable
    backends: tuple[tuple[str, str], ...] = ()

    @classmethod
    def select(cls, backends: dict[str, str] | None = None,
               registry: OpRegistry | None = None) -> "Kernels":
        """Resolve every op from ``registry`` (default: all "reference").

        Args:
            backends: registry op name -> backend name, for ops that should not use
                "reference".
        """
        registry = registry or default_registry()
        backends = dict(backends or {})
        # a kernel set may name ops this model does not call (the functional conv update,
        # say); only names that are no op at all are mistakes
        unknown = sorted(set(backends) - set(registry.ops()))
        if unknown:
            raise ValueError(f"unknown ops {unknown}; ops are {registry.ops()}")
        chosen = {op: backends.get(op, "reference") for op in MODEL_OPS.values()}
        fns = {field: registry.get(op, chosen[op]) for field, op in MODEL_OPS.items()}
        return cls(**fns, backends=tuple(chosen.items()))
