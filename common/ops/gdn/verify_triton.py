"""Triton GDN verify (see ``verify_reference``): one launch per layer, the pool only read.

It runs ``replay_triton.replay_kernel`` over each request's rows with outputs on and the state
store off. Against the EXTEND path on gathered states it saves, per layer, the gathers of the
slots' windows and states, the conv output, the gates, the sequence ids the conv kernel builds,
and the new window and final state that a verify would drop (one launch instead of about ten).
"""

from __future__ import annotations

import torch

from common.ops.gdn import verify_reference as reference
from common.ops.gdn._common import INTERPRET, on_gpu
from common.ops.gdn.replay_triton import launch_replay

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
    """Triton version of :func:`common.ops.gdn.verify_reference.gdn_verify` (same contract).
    ``cu_seqlens`` may be on the host (copied without a wait) or the device; ``slots`` must be
    on the pools' device and is not range-checked (no host read)."""
    args = dict(mixed_qkv=mixed_qkv, a=a, b=b, cu_seqlens=cu_seqlens, conv_pool=conv_pool,
                conv_weight=conv_weight, ssm_pool=ssm_pool, slots=slots, A_log=A_log,
                dt_bias=dt_bias, num_k_heads=num_k_heads, num_v_heads=num_v_heads)
    tensors = (mixed_qkv, a, b, conv_weight, A_log, dt_bias)
    if not ((on_gpu(*tensors, conv_pool, ssm_pool) or INTERPRET)
            and all(x.stride(-1) == 1 for x in tensors)):
        return reference.gdn_verify(**args, scale=scale)
    t, n, dk, dv = reference.check_verify(**args)
    if slots.device != ssm_pool.device:
        raise ValueError(f"slots must be on the pools' device ({ssm_pool.device}), got {slots.device}")
    o = torch.empty(t, num_v_heads, dv, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if t == 0:
        return o
    cu = cu_seqlens.to(device=mixed_qkv.device, dtype=torch.int64, non_blocking=True)
    # one layer: a leading layer dim of 1 on everything the kernel indexes by layer
    launch_replay(qkv=mixed_qkv[None], a=a[None], b=b[None], cu=cu, slots=slots.contiguous(),
                  conv_pool=conv_pool[None], conv_weight=conv_weight[None], A_log=A_log[None],
                  dt_bias=dt_bias[None], ssm_pool=ssm_pool[None], o=o, block=0,
                  scale=dk ** -0.5 if scale is None else scale, num_k_heads=num_k_heads, n=n,
                  output=True, store=False)
    return o
