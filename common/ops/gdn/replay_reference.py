"""Plain-torch replay of GDN tokens from given states: EXTEND's silu conv, gates and
l2-normalised delta rule over packed sequences. The verify op (outputs only) and the commit op
(final states only) are both defined by it; ``replay_triton.py`` is their Triton walk.
"""

from __future__ import annotations

import torch

from common.ops.conv1d.reference import causal_conv1d_prefill
from common.ops.gdn.reference import gdn_gating, recurrent_gated_delta_rule

__all__ = ["replay", "check_layer"]


def check_layer(*, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                conv_pool: torch.Tensor, conv_weight: torch.Tensor, ssm_pool: torch.Tensor,
                slots: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                num_k_heads: int, num_v_heads: int) -> tuple[int, int, int, int, int]:
    """Shape rules of one layer's pre-conv rows, gates, pools and parameters, from metadata
    only; returns (rows, N, K, V, W).

    Args:
        qkv: [rows, conv_dim], channels q | k | v. a, b: [rows, HV].
        conv_pool: [S, conv_dim, W-1]. conv_weight: [conv_dim, W]. ssm_pool: [S, HV, V, K].
        slots: integer [N]. A_log, dt_bias: [HV].
    """
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [rows, conv_dim], got {tuple(qkv.shape)}")
    rows, conv_dim = qkv.shape
    hv = num_v_heads
    if a.shape != (rows, hv) or b.shape != (rows, hv):
        raise ValueError(f"a and b must be [{rows}, {hv}], got {tuple(a.shape)} and {tuple(b.shape)}")
    if ssm_pool.dim() != 4 or ssm_pool.shape[1] != hv:
        raise ValueError(f"ssm_pool must be [S, {hv}, V, K], got {tuple(ssm_pool.shape)}")
    dv, dk = ssm_pool.shape[2], ssm_pool.shape[3]
    if num_k_heads < 1 or hv % num_k_heads != 0:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({num_k_heads})")
    if conv_dim != 2 * num_k_heads * dk + hv * dv:
        raise ValueError(f"qkv has {conv_dim} channels, expected 2*{num_k_heads}*{dk} + {hv}*{dv}")
    if conv_weight.dim() != 2 or conv_weight.shape[0] != conv_dim:
        raise ValueError(f"conv_weight must be [{conv_dim}, W], got {tuple(conv_weight.shape)}")
    width = conv_weight.shape[1]
    want = (ssm_pool.shape[0], conv_dim, width - 1)
    if conv_pool.shape != want:
        raise ValueError(f"conv_pool must be {list(want)} (the slots of ssm_pool), got "
                         f"{tuple(conv_pool.shape)}")
    if slots.dim() != 1 or slots.is_floating_point():
        raise ValueError(f"slots must be an integer tensor [N], got {slots.dtype} {tuple(slots.shape)}")
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"A_log and dt_bias must be [{hv}], got {tuple(A_log.shape)} and "
                         f"{tuple(dt_bias.shape)}")
    return rows, slots.numel(), dk, dv, width


def replay(*, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           cu_seqlens: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
           ssm_state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
           num_k_heads: int, num_v_heads: int, scale: float | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed sequences continued from the given states, exactly as EXTEND computes them.

    Args:
        mixed_qkv: [T, conv_dim] pre-conv rows (q | k | v). a, b: [T, HV] raw gates.
        cu_seqlens: [N+1] offsets of each sequence's rows.
        conv_state: [N, conv_dim, W-1]. ssm_state: [N, HV, V, K] (pool layout, K-last).
        conv_weight: [conv_dim, W]. A_log, dt_bias: [HV]. scale: default K**-0.5.

    Returns:
        o [T, HV, V] in mixed_qkv.dtype, the new conv state [N, conv_dim, W-1] and the new
        recurrent state [N, HV, V, K] (pool layout); nothing is written.
    """
    x, new_conv = causal_conv1d_prefill(x=mixed_qkv, weight=conv_weight, cu_seqlens=cu_seqlens,
                                        initial_state=conv_state, activation="silu")
    t = x.shape[0]
    dv, dk = ssm_state.shape[-2], ssm_state.shape[-1]
    key_dim = num_k_heads * dk
    q = x[:, :key_dim].reshape(t, num_k_heads, dk)
    k = x[:, key_dim:2 * key_dim].reshape(t, num_k_heads, dk)
    v = x[:, 2 * key_dim:].reshape(t, num_v_heads, dv)
    g, beta = gdn_gating(A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    o, final = recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens,
        initial_state=ssm_state.transpose(-1, -2), scale=scale, use_qk_l2norm=True)
    return o, new_conv, final.transpose(-1, -2)
