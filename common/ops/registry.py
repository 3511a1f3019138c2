"""Which implementation of each op to use: op name -> backend name -> lazy factory.

Factories are called on first ``get`` so that a backend's heavy imports (triton, flashinfer) only
happen when it is actually chosen. Three tables feed the default registry: the plain-torch
definitions (``REFERENCE_OPS``), the GPU backends (``GPU_OPS``) and the plain-torch CPU
backends (``CPU_OPS``: the same numbers as the reference, faster on a CPU).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["OpRegistry", "default_registry", "REFERENCE_BACKEND", "PDL_BACKEND", "CPU_BACKEND",
           "REFERENCE_OPS", "GPU_OPS", "CPU_OPS"]

REFERENCE_BACKEND = "reference"
# a Triton op launched as programmatic dependent launches (SM90+): each kernel starts while the
# one before it finishes (common/ops/pdl.py); the op's Triton function with ``pdl=True``
PDL_BACKEND = "triton-pdl"
# plain torch shaped for a CPU: in-place state updates and batched gathers instead of the
# reference's per-request loops and out-of-place temporaries (runs on any device)
CPU_BACKEND = "torch-cpu"

# op name -> module holding its plain-torch definition (attribute of the same name).
REFERENCE_OPS: dict[str, str] = {
    "gdn_gating": "common.ops.gdn.reference",
    "chunk_gated_delta_rule": "common.ops.gdn.reference",
    "recurrent_gated_delta_rule": "common.ops.gdn.reference",
    "causal_conv1d_prefill": "common.ops.conv1d.reference",
    "causal_conv1d_update": "common.ops.conv1d.reference",
    "gdn_decode_in_place": "common.ops.gdn.reference",
    "conv1d_update_in_place": "common.ops.conv1d.reference",
    "gdn_commit_in_place": "common.ops.gdn.commit_reference",
    "gdn_verify": "common.ops.gdn.verify_reference",
    "paged_attention": "common.ops.attention.reference",
    "store_paged_kv": "common.ops.attention.kv_store_reference",
    "qk_norm_rope_store": "common.ops.attention.qk_prep_reference",
    "sigmoid_gate_mul": "common.ops.attention.output_gate_reference",
    "draft_block_attention": "common.ops.attention.draft_reference",
    "rms_norm": "common.ops.norm.reference",
    "add_rms_norm": "common.ops.norm.reference",
    "gated_rms_norm": "common.ops.norm.reference",
    "l2norm": "common.ops.norm.reference",
    "rope_inv_freq": "common.ops.rope.reference",
    "apply_rope": "common.ops.rope.reference",
    "silu_glu_mlp": "common.ops.mlp.reference",
    "silu_and_mul": "common.ops.mlp.reference",
    "sparse_moe": "common.ops.moe.reference",
    "linear": "common.ops.linear.reference",
}

# op name -> GPU backend name -> module holding it (attribute named like the op). Importing the
# module pulls in triton / fla / flashinfer, so it only happens when the backend is first resolved.
GPU_OPS: dict[str, dict[str, str]] = {
    "chunk_gated_delta_rule": {
        "fla": "common.ops.gdn.fla",
        "flashinfer": "common.ops.gdn.flashinfer",
    },
    "recurrent_gated_delta_rule": {
        "fla": "common.ops.gdn.fla",
        "triton": "common.ops.gdn.triton",
    },
    "causal_conv1d_prefill": {"triton": "common.ops.conv1d.triton"},
    "causal_conv1d_update": {"triton": "common.ops.conv1d.triton"},
    "gdn_decode_in_place": {"triton": "common.ops.gdn.triton"},
    "conv1d_update_in_place": {"triton": "common.ops.conv1d.triton"},
    "gdn_commit_in_place": {"triton": "common.ops.gdn.commit_triton"},
    "gdn_verify": {"triton": "common.ops.gdn.verify_triton"},
    "paged_attention": {"flashinfer": "common.ops.attention.flashinfer",
                        "triton": "common.ops.attention.paged_triton"},
    "draft_block_attention": {"triton": "common.ops.attention.draft_triton"},
    # PDL_BACKEND entries: the module's Triton op called with pdl=True (default_registry)
    "rms_norm": {"triton": "common.ops.norm.triton",
                 "triton-pdl": "common.ops.norm.triton"},
    "add_rms_norm": {"triton": "common.ops.norm.triton",
                     "triton-pdl": "common.ops.norm.triton"},
    "gated_rms_norm": {"triton": "common.ops.norm.triton",
                       "triton-pdl": "common.ops.norm.triton"},
    "gdn_gating": {"triton": "common.ops.gdn.gating_triton"},
    "apply_rope": {"triton": "common.ops.rope.triton"},
    "silu_and_mul": {"triton": "common.ops.mlp.triton",
                     "triton-pdl": "common.ops.mlp.triton"},
    "store_paged_kv": {"triton": "common.ops.attention.kv_store_triton"},
    "sparse_moe": {"capturable": "common.ops.moe.capturable", "triton": "common.ops.moe.triton"},
    "qk_norm_rope_store": {"triton": "common.ops.attention.qk_prep_triton"},
    "sigmoid_gate_mul": {"triton": "common.ops.attention.output_gate_triton",
                         "triton-pdl": "common.ops.attention.output_gate_triton"},
    "linear": {"triton": "common.ops.linear.triton",
               "triton-pdl": "common.ops.linear.triton"},
}

# op name -> module holding its CPU_BACKEND (attribute named like the op); plain torch, so
# resolving one imports nothing heavy
CPU_OPS: dict[str, str] = {
    "chunk_gated_delta_rule": "common.ops.gdn.prefill_cpu",
    "gdn_decode_in_place": "common.ops.gdn.decode_cpu",
    "conv1d_update_in_place": "common.ops.conv1d.update_cpu",
    "gdn_verify": "common.ops.gdn.verify_cpu",
    "gdn_commit_in_place": "common.ops.gdn.commit_cpu",
    "paged_attention": "common.ops.attention.paged_cpu",
    "draft_block_attention": "common.ops.attention.draft_cpu",
}

Factory = Callable[[], Callable[..., Any]]


def _import_factory(module: str, attr: str, **options: Any) -> Factory:
    """A factory for ``module.attr``, with ``options`` bound as keyword arguments if any.

    A backend module whose library is imported only inside its functions defines
    ``require()``, raising ImportError when that library cannot load: called here, so a missing
    library fails when the backend is chosen, not in the middle of a forward or a capture."""
    def factory() -> Callable[..., Any]:
        loaded = importlib.import_module(module)
        require = getattr(loaded, "require", None)
        if require is not None:
            require()
        fn = getattr(loaded, attr)
        return functools.partial(fn, **options) if options else fn

    return factory


class OpRegistry:
    """Explicit table of op implementations; resolved functions are cached per registry."""

    def __init__(self) -> None:
        self._factories: dict[str, dict[str, Factory]] = {}
        self._resolved: dict[tuple[str, str], Callable[..., Any]] = {}

    def register(self, op: str, backend: str, factory: Factory, *, replace: bool = False) -> None:
        """Add ``factory`` (no arguments, returns the op's callable) as ``backend`` of ``op``."""
        if not callable(factory):
            raise ValueError(f"factory for {op!r}/{backend!r} must be callable, got {factory!r}")
        backends = self._factories.setdefault(op, {})
        if backend in backends and not replace:
            raise ValueError(f"op {op!r} already has a {backend!r} backend (pass replace=True to override)")
        backends[backend] = factory
        self._resolved.pop((op, backend), None)

    def get(self, op: str, backend: str = REFERENCE_BACKEND) -> Callable[..., Any]:
        """The callable of ``op`` for ``backend``; ValueError naming the known choices otherwise."""
        backends = self._factories.get(op)
        if backends is None:
            raise ValueError(f"unknown op {op!r}; known ops: {', '.join(sorted(self._factories)) or '(none)'}")
        if backend not in backends:
            raise ValueError(
                f"op {op!r} has no backend {backend!r}; supported backends: {', '.join(sorted(backends))}"
            )
        key = (op, backend)
        if key not in self._resolved:
            self._resolved[key] = backends[backend]()
        return self._resolved[key]

    def ops(self) -> list[str]:
        return sorted(self._factories)

    def backends(self, op: str) -> list[str]:
        if op not in self._factories:
            raise ValueError(f"unknown op {op!r}; known ops: {', '.join(sorted(self._factories)) or '(none)'}")
        return sorted(self._factories[op])


def default_registry() -> OpRegistry:
    """A fresh registry with the plain-torch ``reference`` backend of every op, the GPU
    backends of ``GPU_OPS`` and the CPU backends of ``CPU_OPS``. Registration is lazy:
    resolving a backend is what imports its kernel library, so this is safe on a machine
    without a GPU until such a backend is chosen."""
    registry = OpRegistry()
    for op, module in REFERENCE_OPS.items():
        registry.register(op, REFERENCE_BACKEND, _import_factory(module, op))
    for op, backends in GPU_OPS.items():
        for backend, module in backends.items():
            options = {"pdl": True} if backend == PDL_BACKEND else {}
            registry.register(op, backend, _import_factory(module, op, **options))
    for op, module in CPU_OPS.items():
        registry.register(op, CPU_BACKEND, _import_factory(module, op))
    return registry
