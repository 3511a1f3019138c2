"""Named kernel sets: which backend each registry op uses, chosen by name (e.g. ``--kernels gpu``).

Every set maps registry op names to backend names; ops a set leaves out use "reference".
``common.model.kernels.select_kernels(name)`` resolves a set into the model's ``Kernels``
(this module, below the model, only names the choices).

- ``reference``: plain torch everywhere (CPU or GPU; the definition of the numbers).
- ``cpu``: plain torch arranged for a CPU (``torch-cpu`` backends, ``CPU_OPS`` of the
  registry), where the reference loops over requests and tokens and allocates state-sized
  temporaries: the GDN decode step on the pool rows in place, the conv1d update with one
  gather and one scatter, the chunked prefill and the DFLASH verify and commit as the chunked
  rule batched over requests, paged and draft attention over the whole batch in one masked
  matmul (2.4x the reference's speed for a pycoder decode step at batch 16 on one thread,
  3.5x with its draft: docs/kernels.md). The reference's numbers to fp32 rounding; the other
  ops are the reference.
- ``gpu``: the fastest backends measured on H200 (docs/kernel_benchmarks.md): FlashInfer
  chunked GDN prefill (128-dim heads; other head dims and fp32 go to fla), our Triton token
  recurrence (faster than fla's at decode sizes), our Triton conv1d, our Triton steps on the
  state pool by slot (the in-place decode step with its gates, the verify, and the commit of
  verified tokens: no host read, so decode and verify forwards can be captured in CUDA graphs),
  FlashInfer paged attention (fp16/bf16 with head dim 64/128/256; anything else goes to the
  reference), our Triton DFLASH draft block attention. The GEMV and the norm, SwiGLU and
  output-gate kernels launch as programmatic dependent launches (``common/ops/pdl.py``), so
  each starts while the kernel before it finishes (5-6% off a batch-1 decode step on H200,
  docs/performance.md).
- ``gpu-fla``: as ``gpu`` but with fla's chunked prefill, for machines whose FlashInfer lacks
  the CuTe-DSL libraries its GDN kernels need.
- ``gpu-no-pdl``: as ``gpu`` but those kernels launch plainly; the baseline that measures PDL.
- ``gpu-triton-attention``: as ``gpu`` but paged attention is our Triton kernel
  (``common/ops/attention/paged_triton.py``), whose CUDA-graph plans read no length on the
  host (FlashInfer's do), so nothing is planned on the host before a verify's replay; not yet
  timed against FlashInfer on a GPU (docs/kernels.md).

The GPU sets also use our Triton RMSNorm / gated RMSNorm, GDN gates and RoPE: one launch per
call where the reference's elementwise torch code launches 6-10 kernels; likewise the fused
residual add + RMSNorm, the SwiGLU activation, the paged K/V store, the attention layer's q/k
norms + RoPE + K/V store (one launch) and its sigmoid output gate; and our Triton GEMV for
projections of one row (and of 5-16 rows for wide weights), where it read weights faster than
cuBLAS (docs/kernels.md), cuBLAS for the rest. The sparse MoE op is
our Triton kernels (router top-k, gate/up with SwiGLU, weighted down, each reading the chosen
experts in place) while tokens x top-k is at most the expert count, and otherwise plain torch
that reads no value on the host for up to 64 tokens; CUDA graphs replay both. Ops
with no GPU backend (l2norm, rope_inv_freq, MLP) are plain torch, which runs on the GPU.
"""

from __future__ import annotations

from common.ops.registry import (CPU_BACKEND, CPU_OPS, GPU_OPS, PDL_BACKEND, REFERENCE_BACKEND,
                                 REFERENCE_OPS)

__all__ = ["AUTO", "AUTO_ON_CUDA", "AUTO_ON_CUDA_SPECULATIVE", "BACKEND_SETS", "backends_for",
           "chosen_backends", "describe", "sets_for_device"]

_GPU = {
    "chunk_gated_delta_rule": "flashinfer",
    "recurrent_gated_delta_rule": "triton",
    "causal_conv1d_prefill": "triton",
    "causal_conv1d_update": "triton",
    "gdn_decode_in_place": "triton",
    "conv1d_update_in_place": "triton",
    "gdn_commit_in_place": "triton",
    "gdn_verify": "triton",
    "paged_attention": "flashinfer",
    "draft_block_attention": "triton",
    "rms_norm": "triton",
    "gated_rms_norm": "triton",
    "gdn_gating": "triton",
    "apply_rope": "triton",
    "add_rms_norm": "triton",
    "silu_and_mul": "triton",
    "store_paged_kv": "triton",
    "qk_norm_rope_store": "triton",
    "sigmoid_gate_mul": "triton",
    "sparse_moe": "triton",
    "linear": "triton",
}

# the ops whose Triton kernels can launch with PDL (common/ops/pdl.py): the GEMV and the kernels
# in front of it in a decode step
_PDL = {op: PDL_BACKEND for op, backends in GPU_OPS.items() if PDL_BACKEND in backends}

BACKEND_SETS: dict[str, dict[str, str]] = {
    "reference": {},
    "gpu": {**_GPU, **_PDL},
    "gpu-fla": {**_GPU, **_PDL, "chunk_gated_delta_rule": "fla"},
    "gpu-no-pdl": _GPU,
    "gpu-triton-attention": {**_GPU, **_PDL, "paged_attention": "triton"},
    "cpu": {op: CPU_BACKEND for op in CPU_OPS},
}


# the set a worker takes when none is named: the fastest for its device
AUTO = "auto"


def _check_sets() -> None:
    for name, backends in BACKEND_SETS.items():
        for op, backend in backends.items():
            known = {*GPU_OPS.get(op, {}), *([CPU_BACKEND] if op in CPU_OPS else [])}
            if op not in REFERENCE_OPS or backend not in known:
                raise AssertionError(f"kernel set {name!r}: {op!r} has no backend {backend!r}")


_check_sets()


def backends_for(name: str) -> dict[str, str]:
    """The op -> backend overrides of set ``name`` (a copy); ValueError naming the sets otherwise."""
    if name not in BACKEND_SETS:
        raise ValueError(f"unknown kernel set {name!r}; known: {', '.join(sorted(BACKEND_SETS))}")
    return dict(BACKEND_SETS[name])


def chosen_backends(name: str, ops: list[str] | None = None) -> dict[str, str]:
    """Every op of ``ops`` (default: all registry ops) with the backend set ``name`` gives it."""
    overrides = backends_for(name)
    return {op: overrides.get(op, REFERENCE_BACKEND) for op in (ops or sorted(REFERENCE_OPS))}


def describe(name: str, ops: list[str] | None = None) -> str:
    """One line for logs: ``gpu: chunk_gated_delta_rule=flashinfer, ...; rest reference``."""
    chosen = chosen_backends(name, ops)
    special = [f"{op}={b}" for op, b in chosen.items() if b != REFERENCE_BACKEND]
    rest = len(chosen) - len(special)
    return f"{name}: " + ", ".join(special + ([f"{rest} ops reference"] if rest else []))


# what AUTO tries on a CUDA device, in order: the first whose libraries load (the Triton
# attention needs no FlashInfer, whose wheels exist for fewer CUDA and torch versions)
AUTO_ON_CUDA = ("gpu", "gpu-triton-attention")
# ...for a decode engine that speculates on one GPU: the Triton attention plans from lengths
# on the device, so the next DFLASH step is launched before the host reads this one
# (docs/cuda_graphs.md, step 6), which FlashInfer's plans do not allow. On an H100
# (2026-12-06) its plain and DFLASH steps were the faster at batch 1 and 8 besides
# (docs/kernels.md)
AUTO_ON_CUDA_SPECULATIVE = ("gpu-triton-attention",)


def sets_for_device(name: str, device: str, *, speculative_decode: bool = False
                    ) -> tuple[str, ...]:
    """The sets ``name`` may stand for on ``device``, best first: :data:`AUTO` is
    :data:`AUTO_ON_CUDA` on a CUDA device (:data:`AUTO_ON_CUDA_SPECULATIVE` for a
    ``speculative_decode`` engine) and ``cpu`` elsewhere; any other name is itself alone (a
    named set is never swapped for another)."""
    if name == AUTO:
        if not str(device).startswith("cuda"):
            return ("cpu",)
        return AUTO_ON_CUDA_SPECULATIVE if speculative_decode else AUTO_ON_CUDA
    return (name,)
