"""fla-core (flash-linear-attention) Triton kernels behind the Gated DeltaNet op contracts.

- ``chunk_gated_delta_rule``: fla's chunked (WY) prefill, packed varlen (B = 1, ``cu_seqlens``).
- ``recurrent_gated_delta_rule``: fla's ``fused_recurrent_gated_delta_rule``; when the caller asks
  for the state after every token (speculative verify) it runs our kernel in
  ``common.ops.gdn.triton`` instead, since fla's returns only the final state.

Conventions at the boundary (the reference's): q, k ``[T, HK, K]``, v ``[T, HV, V]``, log-space
``g`` and post-sigmoid ``beta`` ``[T, HV]``, K-major state ``[N, HV, K, V]``. fla takes the same
log-space g; its ``state_v_first`` flag lets it read and write K-last ``[N, HV, V, K]`` storage, so
a transposed view of the model's K-last pool rows is consumed without a copy and the final state
comes back as a transposed view of fresh K-last storage. CPU and fp64 inputs go to the reference.

fp32 inputs run fla's ``tl.dot`` in tf32 (its default), so fp32 results agree with the reference
to about 1e-3 relative, not to fp32 rounding.
"""

from __future__ import annotations

import torch

from common.ops.gdn import reference
from common.ops.gdn import triton as gdn_triton
from common.ops.gdn._common import check_shapes, device_cu, on_gpu, state_in

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"]


def _state_out(final: torch.Tensor, v_first: bool) -> torch.Tensor:
    return final.transpose(-1, -2) if v_first else final


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
    """fla version of :func:`common.ops.gdn.reference.chunk_gated_delta_rule` (same contract).

    ``chunk_size`` is passed on when fla supports it (16, 32, 64), else fla's 64 is used: the chunk
    size changes the order of arithmetic, not the result.
    """
    if not on_gpu(q, k, v, g, beta, initial_state):
        return reference.chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
            scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    t, hk, dk, hv, dv, n = check_shapes(q, k, v, g, beta, cu_seqlens, initial_state)
    cu, cu_cpu = device_cu(cu_seqlens, v.device)
    h0, v_first = state_in(initial_state)
    with torch.inference_mode():
        o, final = fla_chunk(
            q[None], k[None], v[None], g[None], beta[None],
            scale=dk ** -0.5 if scale is None else scale,
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
            state_v_first=v_first, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
            chunk_size=chunk_size if chunk_size in (16, 32, 64) else 64)
    return o[0].to(v.dtype), _state_out(final, v_first)


def recurrent_gated_delta_rule(
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
    output_intermediate_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla version of :func:`common.ops.gdn.reference.recurrent_gated_delta_rule` (same contract)."""
    if output_intermediate_states:
        return gdn_triton.recurrent_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
            scale=scale, use_qk_l2norm=use_qk_l2norm, output_intermediate_states=True)
    if not on_gpu(q, k, v, g, beta, initial_state):
        return reference.recurrent_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
            scale=scale, use_qk_l2norm=use_qk_l2norm)
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    t, hk, dk, hv, dv, n = check_shapes(q, k, v, g, beta, cu_seqlens, initial_state)
    cu, _ = device_cu(cu_seqlens, v.device)
    h0, v_first = state_in(initial_state)
    with torch.inference_mode():
        o, final = fused_recurrent_gated_delta_rule(
            q[None], k[None], v[None], g=g[None], beta=beta[None],
            scale=dk ** -0.5 if scale is None else scale,
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
            state_v_first=v_first, cu_seqlens=cu)
    return o[0].to(v.dtype), _state_out(final, v_first)
