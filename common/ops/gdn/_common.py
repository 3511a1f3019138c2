"""Input checks (shared with the reference) and layout helpers of the Gated DeltaNet backends."""

from __future__ import annotations

import os

import torch

# TRITON_INTERPRET=1 runs our own Triton kernels on CPU tensors (the CPU tests use it).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def on_gpu(*tensors: torch.Tensor | None) -> bool:
    """True when every given tensor is a CUDA tensor in a precision the kernels take (not fp64)."""
    present = [t for t in tensors if t is not None]
    return all(t.is_cuda for t in present) and all(t.dtype != torch.float64 for t in present)


def check_tokens(q, k, v, g, beta, gate_names: str = "g and beta"
                 ) -> tuple[int, int, int, int, int]:
    """Shape rules of the per-token inputs (``g``, ``beta``: the two per-head gate inputs,
    named in errors by ``gate_names``); returns (T, HK, K, HV, V)."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, HK, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be [T, HV, V] with T={q.shape[0]}, got {tuple(v.shape)}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk != 0:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"{gate_names} must be [{t}, {hv}], got {tuple(g.shape)} and "
                         f"{tuple(beta.shape)}")
    return t, hk, dk, hv, dv


def sequence_bounds(cu_seqlens: torch.Tensor, t: int) -> list[int]:
    """The offsets ``cu_seqlens`` [N+1] as ints (read on the host); ValueError unless they rise
    from 0 to ``t``."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != t or any(e < s for s, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={t}, got {bounds}")
    return bounds


def check_shapes(q, k, v, g, beta, cu_seqlens, initial_state) -> tuple[int, int, int, int, int, int]:
    """The reference's shape rules, without reading a device tensor on the host.

    Returns (T, HK, K, HV, V, N).
    """
    t, hk, dk, hv, dv = check_tokens(q, k, v, g, beta)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be an integer tensor [N+1] with N >= 1")
    if not cu_seqlens.is_cuda:
        sequence_bounds(cu_seqlens, t)
    n = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n, hv, dk, dv):
        raise ValueError(
            f"initial_state must be [{n}, {hv}, {dk}, {dv}] (K-major), got {tuple(initial_state.shape)}")
    return t, hk, dk, hv, dv, n


def device_cu(cu_seqlens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(int64 cu_seqlens on ``device``, the CPU copy when the caller passed one, else None)."""
    cpu = None if cu_seqlens.is_cuda else cu_seqlens.to(torch.int64)
    return cu_seqlens.to(device=device, dtype=torch.int64, non_blocking=True), cpu


def state_in(initial_state: torch.Tensor | None) -> tuple[torch.Tensor | None, bool]:
    """A K-major ``[N, HV, K, V]`` state as the kernels want it, without copying when possible.

    Returns (tensor, v_first): with v_first the tensor is the contiguous ``[N, HV, V, K]`` storage
    behind a transposed view (how the model passes its K-last pool rows); otherwise it is a
    contiguous ``[N, HV, K, V]`` tensor.
    """
    if initial_state is None:
        return None, False
    vk = initial_state.transpose(-1, -2)
    if vk.is_contiguous():
        return vk, True
    return initial_state.contiguous(), False


def aligned(t: torch.Tensor, align: int = 32) -> torch.Tensor:
    """``t`` if it is contiguous and starts on an ``align``-byte boundary, else a fresh copy.

    CuTe-DSL kernels assume aligned base pointers; a view at an odd storage offset (a slice of a
    fused projection) is contiguous yet misaligned, so ``.contiguous()`` alone is not enough.
    """
    if t.is_contiguous() and t.data_ptr() % align == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # caching-allocator blocks: 512 B aligned
    out.copy_(t)
    return out


def is_aligned(t: torch.Tensor, align: int = 32) -> bool:
    return t.is_contiguous() and t.data_ptr() % align == 0


def check_in_place(q, k, v, a, b, A_log, dt_bias, ssm_pool, slots
                   ) -> tuple[int, int, int, int, int, int]:
    """Shape rules of the in-place decode step (one token per request, raw gate projections),
    read from metadata only.

    Returns (N, HK, K, HV, V, S).
    """
    n, hk, dk, hv, dv = check_tokens(q, k, v, a, b, gate_names="a and b")
    if n < 1:
        raise ValueError("the decode step needs at least one request")
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"A_log and dt_bias must be [{hv}], got {tuple(A_log.shape)} and "
                         f"{tuple(dt_bias.shape)}")
    if slots.dim() != 1 or slots.is_floating_point() or slots.numel() != n:
        raise ValueError(f"slots must be an integer tensor [N={n}], got {slots.dtype} {tuple(slots.shape)}")
    if ssm_pool.dim() != 4:
        raise ValueError(f"ssm_pool must be [S, HV, V, K] (one layer of the pool), got {tuple(ssm_pool.shape)}")
    if tuple(ssm_pool.shape[1:]) != (hv, dv, dk):
        raise ValueError(f"ssm_pool must be [S, {hv}, {dv}, {dk}] (K-last), got {tuple(ssm_pool.shape)}")
    return n, hk, dk, hv, dv, ssm_pool.shape[0]
