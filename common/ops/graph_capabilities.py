"""What CUDA graphs may do with each op backend, declared in one place beside the registry.

A CUDA graph replays the kernels its forward launched at capture, with no Python in between, so
an op a graph carries must read no value on the host, and may hold a fixed number of tokens only.
Paged attention is the exception in kind: graph forwards run it through a planner
(``ForwardBatch.attention``, refreshed before each replay) instead of the op itself.

Each backend whose answer differs from :data:`DEFAULT` (capturable, no token limit) says so in
:data:`GRAPH_CAPABILITIES`. The engine asks :func:`graph_support` (through the model) what the
chosen backends allow, and never names a backend: a new backend declares itself here and the
graph policy follows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from common.ops.moe.capturable import MAX_TOKENS as MOE_MAX_TOKENS
from common.ops.registry import CPU_BACKEND, REFERENCE_BACKEND

__all__ = ["DEFAULT", "GRAPH_CAPABILITIES", "GraphCapability", "GraphSupport", "PLANNED_OPS",
           "capability", "graph_attention_backends", "graph_support"]

# the ops graph forwards run through a planner (the attention of ForwardBatch.attention) rather
# than by calling the op: a backend of one is capturable when it has a ``graph_attention``
PLANNED_OPS = ("paged_attention",)


@dataclass(frozen=True)
class GraphCapability:
    """What CUDA graphs may do with one backend of one op.

    Attributes:
        capturable: a CUDA graph can replay a forward through it (it reads no value on the host).
        max_graph_tokens: the most tokens one captured forward may carry through it (None: no
            limit); past it the backend takes a path that reads the host.
        graph_attention: a backend of a :data:`PLANNED_OPS` op only: ``module:attr`` of
            ``attr(device)``, which returns the factory of the capturable plans graph forwards
            run attention through (keyword arguments ``batch_size``, ``q_len``,
            ``num_qo_heads``, ``num_kv_heads``, ``head_dim``, ``page_size``, ``max_pages``,
            ``dtype``, ``scale``). It runs on CUDA devices only.
    """

    capturable: bool = True
    max_graph_tokens: int | None = None
    graph_attention: str | None = None
    # what ``graph_attention`` handles (None: anything): outside them graph forwards plan
    # attention on the host, so they run uncaptured
    graph_dtypes: tuple[str, ...] | None = None
    graph_head_dims: tuple[int, ...] | None = None

    def plans_graphs_for(self, dtype: torch.dtype | None, head_dim: int | None) -> bool:
        """Whether ``graph_attention`` runs attention of this dtype and head size (None: not
        known, taken as yes)."""
        if self.graph_attention is None:
            return False
        name = None if dtype is None else str(dtype).removeprefix("torch.")
        return ((self.graph_dtypes is None or name is None or name in self.graph_dtypes)
                and (self.graph_head_dims is None or head_dim is None
                     or head_dim in self.graph_head_dims))

    def __post_init__(self) -> None:
        if self.max_graph_tokens is not None and self.max_graph_tokens < 1:
            raise ValueError(f"max_graph_tokens must be at least 1 or None, got "
                             f"{self.max_graph_tokens}")
        if not self.capturable and (self.max_graph_tokens is not None or self.graph_attention):
            raise ValueError("a backend that is not capturable has no graph token limit or "
                             "graph attention")


DEFAULT = GraphCapability()

# op -> backend -> what it allows, where that is not DEFAULT
GRAPH_CAPABILITIES: dict[str, dict[str, GraphCapability]] = {
    "paged_attention": {
        # the op reads each row's lengths on the host; graphs can only run it uncaptured, with
        # the plan made on the host (common/ops/attention/planned.py)
        REFERENCE_BACKEND: GraphCapability(capturable=False),
        # FlashInfer's CUDA-graph decode wrapper reads its page indices from buffers we own;
        # its kernels exist for half precision and these head sizes only (the eager op then
        # falls back to the reference, which graphs cannot capture)
        "flashinfer": GraphCapability(
            graph_attention="common.ops.attention.flashinfer_graph:graph_attention",
            graph_dtypes=("float16", "bfloat16"), graph_head_dims=(64, 128, 256)),
        # our Triton kernel finds each row's length on the device: its plans are buffer
        # updates, with nothing scheduled on the host (head dims up to 256: its plans refuse
        # wider ones)
        "triton": GraphCapability(
            graph_attention="common.ops.attention.triton_graph:graph_attention",
            graph_dtypes=("float32", "float16", "bfloat16")),
        # lengths and pages read on the host, as the reference does
        CPU_BACKEND: GraphCapability(capturable=False),
    },
    # the CPU steps on the state pool loop over slots, and the CPU prefill, verify, commit and
    # draft attention pad to lengths, read on the host
    "chunk_gated_delta_rule": {CPU_BACKEND: GraphCapability(capturable=False)},
    "gdn_decode_in_place": {CPU_BACKEND: GraphCapability(capturable=False)},
    "gdn_verify": {CPU_BACKEND: GraphCapability(capturable=False)},
    "gdn_commit_in_place": {CPU_BACKEND: GraphCapability(capturable=False)},
    "draft_block_attention": {CPU_BACKEND: GraphCapability(capturable=False)},
    "sparse_moe": {
        # groups tokens by expert on the host
        REFERENCE_BACKEND: GraphCapability(capturable=False),
        # both read no host value up to the capturable op's dense limit (common/ops/moe/)
        "capturable": GraphCapability(max_graph_tokens=MOE_MAX_TOKENS),
        "triton": GraphCapability(max_graph_tokens=MOE_MAX_TOKENS),
    },
}


def _check_declarations() -> None:
    for op in PLANNED_OPS:
        for backend, cap in GRAPH_CAPABILITIES.get(op, {}).items():
            if cap.capturable != (cap.graph_attention is not None):
                raise AssertionError(f"{op}={backend}: a planned op is capturable exactly when "
                                     "it has a graph_attention")
    for op, backends in GRAPH_CAPABILITIES.items():
        for backend, cap in backends.items():
            if cap.graph_attention is not None and op not in PLANNED_OPS:
                raise AssertionError(f"{op}={backend}: only {PLANNED_OPS} plan attention")


_check_declarations()


def capability(op: str, backend: str) -> GraphCapability:
    """What CUDA graphs may do with ``backend`` of ``op`` (:data:`DEFAULT` unless declared)."""
    return GRAPH_CAPABILITIES.get(op, {}).get(backend, DEFAULT)


def graph_attention_backends(op: str = PLANNED_OPS[0]) -> list[str]:
    """The backends of ``op`` that graphs can capture (those with a ``graph_attention``)."""
    return sorted(b for b, cap in GRAPH_CAPABILITIES.get(op, {}).items() if cap.graph_attention)


@dataclass(frozen=True)
class GraphSupport:
    """What CUDA graphs may do with a model's forwards, from the backends of the ops they call.

    Attributes:
        max_tokens: the most tokens one captured forward may carry (None: no limit; 0: none,
            because an op of ``not_capturable`` reads the host at any size).
        not_capturable: ``op=backend`` of each called op (attention aside) no graph can replay.
        attention_backend: the backend of the attention op.
        graph_attention: its ``GraphCapability.graph_attention`` (None: attention is planned on
            the host, so graph forwards run uncaptured only).
    """

    max_tokens: int | None
    not_capturable: tuple[str, ...]
    attention_backend: str
    graph_attention: str | None

    def attention_plans(self, paged_attention: Callable[..., Any], device: torch.device, *,
                        capture: bool) -> Callable[..., Any]:
        """The factory of the attention plans a graph runner on ``device`` makes, one per batch
        size (keyword arguments as ``GraphCapability.graph_attention``'s factory takes them).

        The backend's capturable planner where it has one and ``device`` is CUDA (its plans may
        share the state it makes now, a workspace say); else ``paged_attention`` planned on the
        host (``TorchPlannedAttention``), which runs the graph path's buffers uncaptured.

        Raises:
            ValueError: ``capture`` is asked for but there is no capturable planner.
        """
        if self.graph_attention is not None and device.type == "cuda":
            module, _, attr = self.graph_attention.partition(":")
            return getattr(importlib.import_module(module), attr)(device)
        if capture:
            raise ValueError(f"CUDA graphs need a capturable attention backend "
                             f"({', '.join(graph_attention_backends())}), not "
                             f"{self.attention_backend!r}: choose --kernels gpu, or turn graphs "
                             f"off")
        from common.ops.attention.planned import TorchPlannedAttention

        def host_planned(*, q_len: int, scale: float, **_shape: Any) -> TorchPlannedAttention:
            # the kernel reads the plan's page table and lengths itself: no shape to fix
            return TorchPlannedAttention(paged_attention, q_len=q_len, scale=scale, device=device)

        return host_planned


def graph_support(chosen: Mapping[str, str], attention_dtype: torch.dtype | None = None,
                  head_dim: int | None = None) -> GraphSupport:
    """What CUDA graphs may do with forwards calling the ops of ``chosen`` (op -> backend; the
    attention op, if left out, is taken at its reference backend), whose attention runs in
    ``attention_dtype`` with heads of ``head_dim`` (None: not known)."""
    direct = {op: backend for op, backend in chosen.items() if op not in PLANNED_OPS}
    blocked = tuple(sorted(f"{op}={backend}" for op, backend in direct.items()
                           if not capability(op, backend).capturable))
    limits = [capability(op, backend).max_graph_tokens for op, backend in direct.items()]
    limits = [n for n in limits if n is not None]
    max_tokens = 0 if blocked else (min(limits) if limits else None)
    attention = chosen.get(PLANNED_OPS[0], REFERENCE_BACKEND)
    cap = capability(PLANNED_OPS[0], attention)
    return GraphSupport(max_tokens=max_tokens, not_capturable=blocked,
                        attention_backend=attention,
                        graph_attention=cap.graph_attention
                        if cap.plans_graphs_for(attention_dtype, head_dim) else None)
