"""The GDN part of a speculative VERIFY forward, read straight from the state pool.

A VERIFY computes each request's block of draft tokens exactly as EXTEND would, from the
committed conv window and recurrent state of its slot, but must leave the slot as it is (the
commit later folds in only the accepted prefix). So it needs the token outputs and nothing else:
no new window, no final state.
"""

from __future__ import annotations

import torch

from common.ops.gdn.replay_reference import check_layer, replay

__all__ = ["gdn_verify", "check_verify"]


def check_verify(*, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 cu_seqlens: torch.Tensor, conv_pool: torch.Tensor, conv_weight: torch.Tensor,
                 ssm_pool: torch.Tensor, slots: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor, num_k_heads: int, num_v_heads: int
                 ) -> tuple[int, int, int, int]:
    """Shape rules of :func:`gdn_verify`, from metadata only; returns (T, N, K, V)."""
    t, n, dk, dv, _ = check_layer(qkv=mixed_qkv, a=a, b=b, conv_pool=conv_pool,
                                  conv_weight=conv_weight, ssm_pool=ssm_pool, slots=slots,
                                  A_log=A_log, dt_bias=dt_bias, num_k_heads=num_k_heads,
                                  num_v_heads=num_v_heads)
    if cu_seqlens.shape != (n + 1,) or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be an integer tensor [{n + 1}], got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
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
    check_verify(mixed_qkv=mixed_qkv, a=a, b=b, cu_seqlens=cu_seqlens,
                                conv_pool=conv_pool, conv_weight=conv_weight, ssm_pool=ssm_pool,
                                slots=slots, A_log=A_log, dt_bias=dt_bias,
                                num_k_heads=num_k_heads, num_v_heads=num_v_heads)
    rows = slots.to(device=conv_pool.device, dtype=torch.long)
    o, _, _ = replay(mixed_qkv=mixed_qkv, a=a, b=b, cu_seqlens=cu_seqlens,
                     conv_state=conv_pool[rows], conv_weight=conv_weight,
                     ssm_state=ssm_pool[rows], A_log=A_log, dt_bias=dt_bias,
                     num_k_heads=num_k_heads, num_v_heads=num_v_heads, scale=scale)
    return o
