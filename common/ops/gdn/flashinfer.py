"""FlashInfer's CuTe-DSL chunked Gated DeltaNet prefill behind the reference op contract.

FlashInfer's kernel (``flashinfer.gdn_prefill.chunk_gated_delta_rule``; SM90 and newer) differs
from our op at the boundary, and this wrapper converts:

- decay: FlashInfer takes ``alpha = exp(g)`` (linear space, fp32); our op takes log-space ``g``;
- state: FlashInfer's is K-last ``[N, HV, V, K]`` fp32; our op's is K-major ``[N, HV, K, V]``.
  The model passes a transposed view of its K-last pool rows, whose storage is handed over as is;
  the final state is returned as a transposed view of FlashInfer's K-last output;
- inputs must be contiguous with aligned base pointers (the kernels declare 16-byte alignment;
  we require 32 bytes, the strictest FlashInfer GDN kernel's): misaligned or strided inputs are
  copied into fresh buffers first.

Only 128-dim heads in fp16/bf16 on SM90 are served; anything else (other head dims, fp32, CPU,
other GPUs, FlashInfer without its CuTe-DSL libraries: a warning) runs the fla path (``common.ops.gdn.fla``), which itself hands CPU / fp64 to the
reference. :func:`dispatch` names the path a call takes.
"""

from __future__ import annotations

import functools
import warnings

import torch

from common.ops.gdn import fla as gdn_fla
from common.ops.gdn._common import aligned, check_shapes, device_cu, is_aligned, on_gpu

__all__ = ["chunk_gated_delta_rule", "dispatch", "available"]

HEAD_DIM = 128


@functools.cache
def available() -> str | None:
    """None when FlashInfer's SM90 GDN prefill kernel can be loaded, else why not.

    The kernel needs the CUDA-13 CuTe-DSL libraries (``nvidia-cutlass-dsl``); without them
    FlashInfer imports but leaves its GDN entry points unset.
    """
    try:
        from flashinfer import gdn_kernels
        import flashinfer.gdn_prefill  # noqa: F401
    except Exception as exc:  # ImportError, or RuntimeError from a missing CUDA library
        return f"{type(exc).__name__}: {exc}"
    if gdn_kernels.chunk_gated_delta_rule_sm90 is None:
        return "flashinfer.gdn_kernels.chunk_gated_delta_rule_sm90 is unavailable (CuTe-DSL libraries missing)"
    return None


def dispatch(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
             initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True, **_) -> str:
    """Which path a call with these inputs takes.

    Returns "flashinfer" (inputs used in place), "flashinfer+copy" (some input copied into an
    aligned contiguous buffer first) or "fla" (FlashInfer does not serve these inputs).
    """
    if not on_gpu(q, k, v, beta, initial_state):
        return "fla"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return "fla"
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return "fla"
    if torch.cuda.get_device_capability(q.device)[0] != 9:  # the SM90 kernel is the one qualified here
        return "fla"
    if available() is not None:
        warnings.warn(f"FlashInfer GDN prefill unavailable, using fla: {available()}", stacklevel=3)
        return "fla"
    # with use_qk_l2norm, FlashInfer normalises q and k into fresh buffers before its kernel
    inputs = [v, beta] + ([] if use_qk_l2norm else [q, k])
    copies = not all(is_aligned(t) for t in inputs) or beta.dtype != torch.float32
    if initial_state is not None:
        vk = initial_state.transpose(-1, -2)
        copies = copies or not (is_aligned(vk) and vk.dtype == torch.float32)
    return "flashinfer+copy" if copies else "flashinfer"


def chunk_gated_delta_rule(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer version of :func:`common.ops.gdn.reference.chunk_gated_delta_rule` (same contract;
    FlashInfer's chunk size is fixed at 64, ``chunk_size`` only reaches the fla fallback)."""
    path = dispatch(q=q, k=k, v=v, beta=beta, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm)
    if path == "fla":
        return gdn_fla.chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
            scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    from flashinfer.gdn_prefill import chunk_gated_delta_rule as fi_chunk

    t, hk, dk, hv, dv, n = check_shapes(q, k, v, g, beta, cu_seqlens, initial_state)
    cu, cu_cpu = device_cu(cu_seqlens, v.device)
    max_seqlen = None
    if cu_cpu is not None and t > 0:
        max_seqlen = int(cu_cpu.diff().max())
    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(-1, -2)
        h0 = aligned(h0.to(torch.float32) if h0.dtype != torch.float32 else h0)
    alpha = torch.exp(g.to(torch.float32))  # fresh, contiguous, aligned
    beta = aligned(beta.to(torch.float32) if beta.dtype != torch.float32 else beta)
    if not use_qk_l2norm:  # else FlashInfer writes normalised q, k into fresh buffers itself
        q, k = aligned(q), aligned(k)
    o, final = fi_chunk(
        q, k, aligned(v), g=alpha, beta=beta,
        scale=dk ** -0.5 if scale is None else scale,
        initial_state=h0, output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=use_qk_l2norm, max_seqlen=max_seqlen)
    return o.to(v.dtype), final.transpose(-1, -2)
