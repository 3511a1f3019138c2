"""Plain-torch store of new tokens' K/V into one layer of the paged KV pool."""

from __future__ import annotations

import torch

__all__ = ["store_paged_kv", "check_store_args"]


def check_store_args(kv: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """ValueError unless kv is [pages, 2, page_size, KVH, D], k and v [T, KVH, D], loc integer [T]."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [num_pages, 2, page_size, KVH, D], got {tuple(kv.shape)}")
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != tuple(kv.shape[3:]):
        raise ValueError(f"k and v must both be [T, {kv.shape[3]}, {kv.shape[4]}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if loc.dim() != 1 or loc.shape[0] != k.shape[0] or loc.is_floating_point():
        raise ValueError(f"loc must be an integer [{k.shape[0]}] tensor, got {tuple(loc.shape)} {loc.dtype}")


def store_paged_kv(*, kv: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write token t's K to ``kv[page, 0, offset]`` and its V to ``kv[page, 1, offset]``, in place,
    where ``page, offset = divmod(loc[t], page_size)``; values are cast to kv.dtype.

    This is :meth:`common.cache.kv_pool.KVPool.write` on one layer. Slots must be distinct, except
    that padding tokens may share scratch slot 0 (page 0 is scratch; which of them lands there is
    unspecified). Slots are not range-checked beyond what torch's indexing does.

    Args:
        kv: one layer of the pool, [num_pages, 2, page_size, KVH, D] (``KVPool.layer_kv``), or
            any strided view of that shape.
        loc: [T] integer flat slots, ``page * page_size + offset``, on kv's device.
        k, v: [T, KVH, D].
    """
    check_store_args(kv, loc, k, v)
    page_size = kv.shape[2]
    page, offset = loc // page_size, loc % page_size
    kv[page, 0, offset] = k.to(kv.dtype)
    kv[page, 1, offset] = v.to(kv.dtype)
