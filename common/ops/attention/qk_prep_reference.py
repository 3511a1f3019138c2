"""Plain-torch preparation of a full-attention layer's q and k after the qkv projection.

q_norm and k_norm (zero-centred RMSNorm per head), partial NeoX RoPE of q and k, and the store of
the rotated k and of v into the paged KV cache, as the separate ops compute them one after the
other. This composition is the specification the fused backend must reproduce.
"""

from __future__ import annotations

import torch

from common.ops.attention.kv_store_reference import check_store_args, store_paged_kv
from common.ops.norm.reference import rms_norm
from common.ops.rope.reference import apply_rope

__all__ = ["qk_norm_rope_store", "check_qk_prep_args"]


def check_qk_prep_args(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                       kv: torch.Tensor, loc: torch.Tensor) -> None:
    """ValueError unless the arguments of :func:`qk_norm_rope_store` fit together (see there)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k [T, KVH, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    d = q.shape[2]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.dim() != 1 or w.shape[0] != d:
            raise ValueError(f"{name} must be [{d}] (the head dim), got {tuple(w.shape)}")
    if positions.shape != (q.shape[0],) or positions.is_floating_point():
        raise ValueError(f"positions must be an integer [{q.shape[0]}] tensor, got {tuple(positions.shape)}")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > d:
        raise ValueError(f"inv_freq must be [r/2] with r <= head dim {d}, got {tuple(inv_freq.shape)}")
    check_store_args(kv, loc, k, v)


def qk_norm_rope_store(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                       inv_freq: torch.Tensor, kv: torch.Tensor,
                       loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise, rotate and cache one step's q / k / v; returns the rotated (q, k).

    Exactly ``rms_norm`` (zero-centred, the ``RMSNorm`` module's rule) of every q and k head,
    rounded to the input dtype, then ``apply_rope`` of both, then ``store_paged_kv`` of the
    rotated k and of v; inputs other than ``kv`` are never written.

    Args:
        q: [T, H, D], e.g. the q half of each head of the [T, H, 2 * D] q|gate projection.
        k, v: [T, KVH, D], e.g. views of the fused projection's output.
        q_weight, k_weight: [D] zero-centred norm weights (the scale is ``1 + w``).
        eps: added to the mean square.
        positions: [T] integer absolute positions.
        inv_freq: [rotary_dim / 2] with rotary_dim <= D, as ``rope_inv_freq`` makes it.
        kv: one layer of the paged pool [num_pages, 2, page_size, KVH, D], written in place.
        loc: [T] integer flat cache slots (see ``store_paged_kv``).

    Returns:
        (q, k): new [T, H, D] and [T, KVH, D] tensors in q.dtype and k.dtype.
    """
    check_qk_prep_args(q=q, k=k, v=v, q_weight=q_weight, k_weight=k_weight, positions=positions,
                       inv_freq=inv_freq, kv=kv, loc=loc)
    q = rms_norm(x=q, weight=q_weight, eps=eps, zero_centered=True)
    k = rms_norm(x=k, weight=k_weight, eps=eps, zero_centered=True)
    q, k = apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
    store_paged_kv(kv=kv, loc=loc, k=k, v=v)
    return q, k
