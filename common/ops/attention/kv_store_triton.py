"""Triton store of new tokens' K and V into one layer of the paged KV pool, in one launch.

Same contract as :func:`common.ops.attention.kv_store_reference.store_paged_kv`: token t's K and V
go to ``kv[page, 0, offset]`` and ``kv[page, 1, offset]`` with ``page, offset = divmod(loc[t],
page_size)``, cast to kv.dtype (round to nearest even, as torch's ``.to``). ``loc`` is read on the
GPU, never on the host, so a decode step that stores its K/V can be captured in a CUDA graph and
replayed after ``loc`` is rewritten in place. Slots are not range-checked on the GPU.

``kv`` is written in place through its own strides (the pool layer ``[pages, 2, page_size, KVH, D]``
or any view of that shape with a contiguous last dim); k and v ``[T, KVH, D]`` may be strided
views (e.g. of a fused projection) with contiguous last dims. Grid: one program per (token, block
of kv heads); each program stores that token's K and V heads.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from common.ops.attention import kv_store_reference as reference

__all__ = ["store_paged_kv"]

# TRITON_INTERPRET=1 runs the kernel on CPU tensors, to step through it without a GPU.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 4096  # elements of K (and as many of V) per program


@triton.jit
def _store_kernel(
    kv, s_page, s_kv, s_off, s_head, loc, stride_loc,
    k, skt, skh, v, svt, svh, KVH, D, page_size,
    BHEADS: tl.constexpr, BD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = (tl.program_id(1) * BHEADS + tl.arange(0, BHEADS)).to(tl.int64)
    d = tl.arange(0, BD)
    mask = (heads < KVH)[:, None] & (d < D)[None, :]
    slot = tl.load(loc + t * stride_loc).to(tl.int64)
    page = slot // page_size
    offset = slot % page_size
    dst = kv + page * s_page + offset * s_off + heads[:, None] * s_head + d[None, :]
    ty = kv.dtype.element_ty
    kt = tl.load(k + t * skt + heads[:, None] * skh + d[None, :], mask=mask)
    tl.store(dst, kt.to(ty), mask=mask)
    vt = tl.load(v + t * svt + heads[:, None] * svh + d[None, :], mask=mask)
    tl.store(dst + s_kv, vt.to(ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def store_paged_kv(*, kv: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Triton version of :func:`common.ops.attention.kv_store_reference.store_paged_kv` (same
    contract). CPU tensors, other dtypes (e.g. fp64), a kv whose last dim is not contiguous, or
    loc on another device go to the reference."""
    reference.check_store_args(kv, loc, k, v)
    served = all((t.is_cuda or _INTERPRET) and t.device == kv.device for t in (kv, loc, k, v))
    kv_in_place = kv.stride(-1) == 1 or kv.shape[-1] <= 1  # kv cannot be copied: it is the output
    if not served or any(t.dtype not in _DTYPES for t in (kv, k, v)) or not kv_in_place:
        reference.store_paged_kv(kv=kv, loc=loc, k=k, v=v)
        return
    t, kvh, d = k.shape
    if t == 0 or kvh == 0 or d == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    bd = triton.next_power_of_2(d)
    bheads = max(1, min(triton.next_power_of_2(kvh), _TILE // bd))
    _store_kernel[(t, triton.cdiv(kvh, bheads))](
        kv, kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), loc, loc.stride(0),
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), kvh, d, kv.shape[2],
        BHEADS=bheads, BD=bd, num_warps=max(1, min(4, bheads * bd // 256)))
