"""Triton commit of a speculative verify into the GDN pool (see ``commit_reference``).

Two launches for all layers (a grid axis per layer) and no host read: the accepted lengths stay
on the device, so the commit can follow acceptance without a synchronisation and can be
captured.

1. ``replay_triton.replay_kernel`` walks each request's accepted tokens from its slot's state
   (conv and gates computed on the way, as EXTEND's kernels compute them) and stores the final
   state.
2. ``_commit_window_kernel``, one program per (request, channel block, layer): the new window
   is the last W-1 inputs of ``old window | accepted rows``. It runs after (1) on the stream, because
   (1) reads the old window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.ops.gdn import commit_reference as reference
from common.ops.gdn._common import INTERPRET, on_gpu
from common.ops.gdn.replay_triton import launch_replay

__all__ = ["gdn_commit_in_place"]


@triton.jit
def _commit_window_kernel(
    qkv, q_l, stride_r, accepted, slots, conv, c_l, c_s, c_d, c_w, block, D,
    W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64)
    qkv += i_l * q_l
    conv += i_l * c_l
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    length = tl.load(accepted + n).to(tl.int64)
    i_s = tl.load(slots + n).to(tl.int64)
    cols = tl.arange(0, BW)[None, :]
    live = mask_d[:, None] & (cols < W - 1)
    i = length + cols  # index into cat(old window, accepted rows)
    from_rows = i >= W - 1
    xv = tl.load(qkv + (n * block + i - (W - 1)) * stride_r + offs_d[:, None],
                 mask=live & from_rows, other=0.0)
    row = conv + i_s * c_s + offs_d[:, None] * c_d
    sv = tl.load(row + i * c_w, mask=live & (i < W - 1), other=0.0)
    val = tl.where(from_rows, xv.to(conv.dtype.element_ty), sv)
    # other threads of this program may still be reading the old window columns being replaced
    tl.debug_barrier()
    tl.store(row + cols * c_w, val, mask=live)


def _supported(*tensors: torch.Tensor) -> bool:
    return (on_gpu(*tensors) or INTERPRET) and all(t.stride(-1) == 1 for t in tensors)


def gdn_commit_in_place(
    *,
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    block: int,
    accepted: torch.Tensor,
    conv_pool: torch.Tensor,
    conv_weight: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    num_v_heads: int,
    scale: float | None = None,
) -> None:
    """Triton version of :func:`common.ops.gdn.commit_reference.gdn_commit_in_place` (same
    contract). ``accepted`` and ``slots`` must live on the pools' device; neither is read on the
    host, so out-of-range values are out-of-bounds accesses, not errors."""
    args = dict(qkv=qkv, a=a, b=b, block=block, accepted=accepted, conv_pool=conv_pool,
                conv_weight=conv_weight, ssm_pool=ssm_pool, slots=slots, A_log=A_log,
                dt_bias=dt_bias, num_k_heads=num_k_heads, num_v_heads=num_v_heads)
    if not _supported(qkv, a, b, conv_weight, A_log, dt_bias):
        return reference.gdn_commit_in_place(**args, scale=scale)
    layers, n, dk, dv, width = reference.check_commit(**args)
    for name, t in (("accepted", accepted), ("slots", slots)):
        if t.device != ssm_pool.device:
            raise ValueError(f"{name} must be on the pools' device ({ssm_pool.device}), got {t.device}")
    if n == 0:
        return
    accepted = accepted.contiguous()
    slots = slots.contiguous()
    launch_replay(qkv=qkv, a=a, b=b, lengths=accepted, slots=slots,
                  conv_pool=conv_pool, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias,
                  ssm_pool=ssm_pool, o=ssm_pool, block=block, scale=1.0,
                  num_k_heads=num_k_heads, n=n, output=False, store=True)
    conv_dim = qkv.shape[2]
    bd = 128
    _commit_window_kernel[(n, triton.cdiv(conv_dim, bd), layers)](
        qkv, *qkv.stride()[:2], accepted, slots, conv_pool, *conv_pool.stride(), block, conv_dim,
        W=width, BW=triton.next_power_of_2(max(width - 1, 1)), BD=bd,
    )
