"""The set of kernel functions one model instance calls, chosen once when it is built."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Callable

from common.ops.gpu_backends import backends_for
from common.ops.graph_capabilities import GraphSupport, graph_support
from common.ops.registry import REFERENCE_BACKEND, OpRegistry, default_registry


@dataclass(frozen=True)
class Kernels:
    """Resolved kernel callables; the model never looks a backend up at call time.

    Every field but ``backends`` is named like its op in the registry
    (``common/ops/registry.py``), so one name finds an op in the model, in a kernel set and in
    its modules.
    """

    rms_norm: Callable
    add_rms_norm: Callable
    gated_rms_norm: Callable
    causal_conv1d_prefill: Callable
    gdn_gating: Callable
    chunk_gated_delta_rule: Callable
    gdn_verify: Callable
    gdn_decode_in_place: Callable
    conv1d_update_in_place: Callable
    gdn_commit_in_place: Callable
    apply_rope: Callable
    paged_attention: Callable
    store_paged_kv: Callable
    qk_norm_rope_store: Callable
    sigmoid_gate_mul: Callable
    draft_block_attention: Callable
    silu_and_mul: Callable
    sparse_moe: Callable
    linear: Callable
    # (op, backend) for every op above: what each field was resolved from
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
        chosen = {op: backends.get(op, "reference") for op in MODEL_OPS}
        fns = {op: registry.get(op, backend) for op, backend in chosen.items()}
        return cls(**fns, backends=tuple(chosen.items()))

    def graph_support(self, ops: Iterable[str], attention_dtype: torch.dtype | None = None,
                      head_dim: int | None = None) -> GraphSupport:
        """What CUDA graphs may do with forwards calling ``ops`` (attention in
        ``attention_dtype`` over heads of ``head_dim``), as the chosen backends declare
        (``common/ops/graph_capabilities.py``)."""
        chosen = dict(self.backends)
        return graph_support({op: chosen.get(op, REFERENCE_BACKEND) for op in ops},
                             attention_dtype, head_dim)


# every op the model calls: the registry names of the Kernels fields
MODEL_OPS: tuple[str, ...] = tuple(f.name for f in fields(Kernels) if f.name != "backends")


def select_kernels(name: str) -> Kernels:
    """The :class:`Kernels` of kernel set ``name`` (``common/ops/gpu_backends.py``). Resolves, and
    so imports, the chosen backends now: a missing GPU library fails here, not mid-forward."""
    try:
        return Kernels.select(backends=backends_for(name), registry=default_registry())
    except ImportError as exc:
        raise ValueError(f"kernel set {name!r} needs its GPU libraries ({exc}); install the "
                         "package's `gpu` extra, or use --kernels reference") from exc
