"""The GDN part of a speculative VERIFY forward in plain torch, fast on the CPU: the outputs of
each request's block from its slot, the pools only read (``verify_reference.py`` defines it)."""

from __future__ import annotations

import torch

from common.ops.gdn.replay_cpu import CHUNK, replay, sequence_lengths
from common.ops.gdn.verify_reference import check_verify
from common.ops.padded_block import padded

__all__ = ["gdn_verify"]


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
    """Token outputs of packed sequences continuing from pool rows ``slots``; the contract of
    ``verify_reference.gdn_verify`` (same arguments, same result to fp32 rounding), computed
    by the batched chunked walk of ``replay_cpu``. The cu_seqlens and slots are read on the
    host.

    Args:
        mixed_qkv: [T, conv_dim] pre-conv rows, channels q | k | v; rows may be strided.
        a, b: [T, HV] raw gate projections.
        cu_seqlens: [N+1] offsets of each request's rows.
        conv_pool: [S, conv_dim, W-1]; ssm_pool: [S, HV, V, K] K-last; neither is written.
        conv_weight: [conv_dim, W]. A_log, dt_bias: [HV]. slots: integer [N] pool rows.
        scale: query scale (default K**-0.5).

    Returns:
        o: [T, HV, V] in mixed_qkv.dtype.
    """
    t = check_verify(mixed_qkv=mixed_qkv, a=a, b=b, cu_seqlens=cu_seqlens, conv_pool=conv_pool,
                     conv_weight=conv_weight, ssm_pool=ssm_pool, slots=slots, A_log=A_log,
                     dt_bias=dt_bias, num_k_heads=num_k_heads, num_v_heads=num_v_heads)[0]
    lens = sequence_lengths(cu_seqlens, t)
    n, length = len(lens), max(lens)
    rows = slots.to(device=conv_pool.device, dtype=torch.long)
    dt = torch.float64 if mixed_qkv.dtype == torch.float64 else torch.float32
    if length <= CHUNK and ssm_pool.dtype == dt:
        # one chunk only reads the states: the pool rows themselves
        states = [ssm_pool[r] for r in rows.tolist()]
    else:
        # stepped between chunks: copies, never the pool's rows
        states = ssm_pool.index_select(0, rows).to(dt)
    index, real = padded(lens, mixed_qkv.device)

    def block(x: torch.Tensor) -> torch.Tensor:
        return (x if index is None else x.index_select(0, index)).reshape(n, length, x.shape[-1])

    o, _ = replay(qkv=block(mixed_qkv), a=block(a), b=block(b), lens=lens,
                  conv_state=conv_pool.index_select(0, rows), conv_weight=conv_weight,
                  states=states, A_log=A_log, dt_bias=dt_bias, num_k_heads=num_k_heads,
                  num_v_heads=num_v_heads, scale=scale, final_state=False)
    return o.flatten(0, 1) if real is None else o[real]
