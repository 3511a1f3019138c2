"""The GDN part of a speculative VERIFY forward, read straight from the state pool.

A VERIFY computes each request's block of draft tokens exactly as EXTEND would, from the
committed conv window and recurrent state of its slot, but must leave the slot as it is (the
commit later folds in only the accepted prefix). So it needs the token outputs and nothing else:
no new window, no final state.
"""

from __future__ import annotations

import torch

from common.ops.conv1d.reference import causal_conv1d_prefill
from common.ops.gdn.reference import gdn_gating, recurrent_gated_delta_rule

__all__ = ["gdn_verify", "check_verify"]


def check_verify(*, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 cu_seqlens: torch.Tensor, conv_pool: torch.Tensor, conv_weight: torch.Tensor,
                 ssm_pool: torch.Tensor, slots: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor, num_k_heads: int, num_v_heads: int
                 ) -> tuple[int, int, int, int]:
    """Shape rules of :func:`gdn_verify`, from metadata only; returns (T, N, K, V)."""
    if mixed_qkv.dim() != 2:
        raise ValueError(f"mixed_qkv must be [T, conv_dim], got {tuple(mixed_qkv.shape)}")
    t, conv_dim = mixed_qkv.shape
    hv = num_v_heads
    if a.shape != (t, hv) or b.shape != (t, hv):
        raise ValueError(f"a and b must be [{t}, {hv}], got {tuple(a.shape)} and {tuple(b.shape)}")
    if ssm_pool.dim() != 4 or ssm_pool.shape[1] != hv:
        raise ValueError(f"ssm_pool must be [S, {hv}, V, K], got {tuple(ssm_pool.shape)}")
    dv, dk = ssm_pool.shape[2], ssm_pool.shape[3]
    if num_k_heads < 1 or hv % num_k_heads != 0:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({num_k_heads})")
    if conv_dim != 2 * num_k_heads * dk + hv * dv:
        raise ValueError(f"mixed_qkv has {conv_dim} channels, expected 2*{num_k_heads}*{dk} + "
                         f"{hv}*{dv}")
    if conv_weight.dim() != 2 or conv_weight.shape[0] != conv_dim:
        raise ValueError(f"conv_weight must be [{conv_dim}, W], got {tuple(conv_weight.shape)}")
    width = conv_weight.shape[1]
    if conv_pool.dim() != 3 or conv_pool.shape[1:] != (conv_dim, width - 1):
        raise ValueError(f"conv_pool must be [S, {conv_dim}, {width - 1}], got "
                         f"{tuple(conv_pool.shape)}")
    n = slots.numel()
    if slots.dim() != 1 or slots.is_floating_point():
        raise ValueError(f"slots must be an integer tensor [N], got {slots.dtype} {tuple(slots.shape)}")
    if cu_seqlens.shape != (n + 1,) or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be an integer tensor [{n + 1}], got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"A_log and dt_bias must be [{hv}], got {tuple(A_log.shape)} and "
                         f"{tuple(dt_bias.shape)}")
    return t, n, dk, dv


def gdn_verify(
    *,
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    conv_weight: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    num_v_heads: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Token outputs of packed sequences continuing from pool rows ``slots``; the pools are only
    read.

    Exactly EXTEND's GDN mixing: silu causal conv from the slot's window
    (``causal_conv1d_prefill``), gates (``gdn_gating``), then the l2-normalised gated delta rule
    from the slot's state (``recurrent_gated_delta_rule``).

    Args:
        mixed_qkv: [T, conv_dim] pre-conv rows, channels q | k | v; rows may be strided.
        a, b: [T, HV] raw gate projections.
        cu_seqlens: [N+1] offsets of each request's rows (host or device).
        conv_pool: [S, conv_dim, W-1]; ssm_pool: [S, HV, V, K] K-last; neither is written.
        conv_weight: [conv_dim, W]. A_log, dt_bias: [HV]. slots: integer [N] pool rows.
        scale: query scale (default K**-0.5).

    Returns:
        o: [T, HV, V] in mixed_qkv.dtype.
    """
    t, n, dk, dv = check_verify(mixed_qkv=mixed_qkv, a=a, b=b, cu_seqlens=cu_seqlens,
                                conv_pool=conv_pool, conv_weight=conv_weight, ssm_pool=ssm_pool,
                                slots=slots, A_log=A_log, dt_bias=dt_bias,
                                num_k_heads=num_k_heads, num_v_heads=num_v_heads)
    rows = slots.to(device=conv_pool.device, dtype=torch.long)
    x, _ = causal_conv1d_prefill(x=mixed_qkv, weight=conv_weight, cu_seqlens=cu_seqlens,
                                 initial_state=conv_pool[rows], activation="silu")
    key_dim = num_k_heads * dk
    q = x[:, :key_dim].reshape(t, num_k_heads, dk)
    k = x[:, key_dim:2 * key_dim].reshape(t, num_k_heads, dk)
    v = x[:, 2 * key_dim:].reshape(t, num_v_heads, dv)
    g, beta = gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    o, _ = recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens,
        initial_state=ssm_pool[rows].transpose(-1, -2), scale=scale, use_qk_l2norm=True)
    return o
