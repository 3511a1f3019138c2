"""Triton attention of DFLASH draft blocks over their paged context KV plus the block's own keys.

Same contract as :func:`common.ops.attention.draft_reference.draft_block_attention`, with one
addition: ``context_lens`` and ``start_positions`` may be integer tensors on the GPU, which are
never read on the host. With them (and a GPU ``page_table``) a call launches exactly one kernel
whose grid depends on shapes only, so it can be captured in a CUDA graph and replayed after the
lengths and the page table are changed in place.

One program handles one request and a group of query heads sharing one kv head: its rows are
(head, block query) pairs, padded to a power of two. It walks the request's context keys in
blocks gathered through the page table (from the start of the sliding window when there is one),
then the block's own B keys, with an online softmax in fp32. Scores use fp32 accumulation; for
fp32 inputs the dots run in IEEE fp32 (not tf32) so results agree with the reference to fp32
rounding; for bf16/fp16 the probabilities are rounded to the value dtype before the P·V dot, as
FlashAttention does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from common.ops.attention import draft_reference as reference
from common.ops.attention.reference import as_lengths

__all__ = ["draft_block_attention"]

# TRITON_INTERPRET=1 runs the kernel on CPU tensors (fp32/fp16), to step through it without a GPU.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MAX_BLOCK = 64  # block sizes above this go to the reference (rows would not fit in registers)
_MAX_HEAD_DIM = 256
_MAX_ROWS = 64  # (head, query) rows per program
_NO_WINDOW = 1 << 30  # a window no position difference reaches


@triton.jit
def _attend(qt, kt, vt, qp, kp, k_ok, m_i, l_i, acc, qk_scale, window,
            CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step of the rows ``qt`` [M, BD] over keys ``kt``/``vt`` [BN, BD]."""
    s = tl.dot(qt, tl.trans(kt), input_precision=PREC) * qk_scale  # log2 domain
    delta = qp[:, None] - kp[None, :]
    vis = k_ok[None, :] & (delta < window)
    if CAUSAL:
        vis = vis & (delta >= 0)
    else:
        vis = vis & (-delta < window)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no visible key yet keeps m = -inf; subtract 0 there so that
    # exp2(-inf - m) is 0 instead of nan
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _draft_attention_kernel(
    q, bk, bv, kc, vc, table, ctx_lens, starts, o,
    sq_n, sq_b, sq_h, sbk_n, sbk_b, sbk_h, sbv_n, sbv_b, sbv_h,
    skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, st_n, st_p, so_n, so_b, so_h,
    B, D, qk_scale, window,
    PAGE: tl.constexpr, G: tl.constexpr, HPP: tl.constexpr, M: tl.constexpr, BP: tl.constexpr,
    BKB: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    chunks = (G + HPP - 1) // HPP  # programs per kv head (constexpr)
    kvh = tl.program_id(1) // chunks
    rows = tl.arange(0, M)
    qi = rows % BP  # block query of the row
    hg = (tl.program_id(1) % chunks) * HPP + rows // BP  # query head within the kv head's group
    row_ok = (qi < B) & (rows // BP < HPP) & (hg < G)
    head = kvh * G + hg
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    ctx = tl.load(ctx_lens + r).to(tl.int32)
    start = tl.load(starts + r).to(tl.int32)
    qp = start + qi

    qt = tl.load(q + r * sq_n + qi[:, None] * sq_b + head[:, None] * sq_h + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, BD], dtype=tl.float32)

    # context keys: nothing before the window of the block's first query can be visible
    lo = tl.maximum(start - window + 1, 0)
    for k0 in range(lo, ctx, BN):
        kp = k0 + tl.arange(0, BN)
        k_ok = kp < ctx
        # int64 page ids: page * page stride overflows int32 in large pools
        page = tl.load(table + r * st_n + (kp // PAGE) * st_p, mask=k_ok, other=0).to(tl.int64)
        slot = kp % PAGE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        kt = tl.load(kc + page[:, None] * skc_p + slot[:, None] * skc_s + kvh * skc_h
                     + offs_d[None, :], mask=kv_mask, other=0.0)
        vt = tl.load(vc + page[:, None] * svc_p + slot[:, None] * svc_s + kvh * svc_h
                     + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend(qt, kt, vt, qp, kp, k_ok, m_i, l_i, acc, qk_scale, window,
                                CAUSAL, PREC)

    # the block's own keys, at positions start .. start+B-1
    j = tl.arange(0, BKB)
    j_ok = j < B
    kv_mask = j_ok[:, None] & d_ok[None, :]
    kt = tl.load(bk + r * sbk_n + j[:, None] * sbk_b + kvh * sbk_h + offs_d[None, :],
                 mask=kv_mask, other=0.0)
    vt = tl.load(bv + r * sbv_n + j[:, None] * sbv_b + kvh * sbv_h + offs_d[None, :],
                 mask=kv_mask, other=0.0)
    m_i, l_i, acc = _attend(qt, kt, vt, qp, start + j, j_ok, m_i, l_i, acc, qk_scale, window,
                            CAUSAL, PREC)

    # every real row sees at least its own key; only padding rows can have l = 0
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o + r * so_n + qi[:, None] * so_b + head[:, None] * so_h + offs_d[None, :],
             out.to(o.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _supported(*tensors: torch.Tensor) -> bool:
    return (all(t.is_cuda or _INTERPRET for t in tensors)
            and all(t.dtype in (torch.float32, torch.float16, torch.bfloat16) for t in tensors)
            and len({t.dtype for t in tensors}) == 1)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _heads_per_program(n: int, kv_heads: int, group: int, block_pow2: int, sms: int) -> int:
    """Query heads one program takes (a power of two): the whole group while that leaves enough
    programs to fill the GPU, fewer (re-reading the kv head's keys, mostly from L2) otherwise."""
    hpp = min(triton.next_power_of_2(group), max(1, _MAX_ROWS // block_pow2))
    while hpp > 1 and n * kv_heads * triton.cdiv(group, hpp) < sms:
        hpp //= 2
    return hpp


def _key_block(row_bytes: int) -> int:
    """Context keys per loop step: smaller for wide rows, so that the pipelined K and V tiles
    (three stages by default) stay well inside shared memory (~100 KB at most)."""
    return 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16


def _device_lengths(name: str, value, n: int, device: torch.device):
    """(int tensor [n] on ``device``, host ints or None). GPU tensors are never read here."""
    if torch.is_tensor(value) and value.device.type != "cpu":
        if value.shape != (n,) or value.is_floating_point() or value.is_complex():
            raise ValueError(f"{name} must be an integer tensor [{n}], got {value.dtype} "
                             f"{tuple(value.shape)}")
        if value.dtype not in (torch.int32, torch.int64):
            value = value.to(torch.int32)
        return value.contiguous(), None
    ints = as_lengths(name, value, n)
    return torch.tensor(ints, dtype=torch.int32).to(device, non_blocking=True), ints


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def draft_block_attention(
    *,
    q: torch.Tensor,
    block_k: torch.Tensor,
    block_v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: Sequence[int] | torch.Tensor,
    start_positions: Sequence[int] | torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`common.ops.attention.draft_reference.draft_block_attention`.

    Same arguments and result ([N, B, H, D] in q.dtype), plus: ``context_lens`` and
    ``start_positions`` may be int32/int64 GPU tensors [N]. Those are never read on the host, so
    the call has no host synchronisation and can be captured in a CUDA graph; the range checks
    that need their values (context within the page table, context <= start) are then the
    caller's. Page ids are never checked here. Lists and CPU tensors are checked as the
    reference checks them.

    CPU tensors (unless TRITON_INTERPRET=1), fp64, mixed input dtypes, B > 64 and D > 256 go to
    the reference.
    """
    args = dict(q=q, block_k=block_k, block_v=block_v, k_cache=k_cache, v_cache=v_cache,
                page_table=page_table, context_lens=context_lens,
                start_positions=start_positions, scale=scale, causal=causal,
                sliding_window=sliding_window)
    n, b, h, d, kvh = reference.check_shapes(q=q, block_k=block_k, block_v=block_v,
                                             k_cache=k_cache, v_cache=v_cache,
                                             page_table=page_table, sliding_window=sliding_window)
    if not _supported(q, block_k, block_v, k_cache, v_cache) or b > _MAX_BLOCK \
            or d > _MAX_HEAD_DIM:
        return reference.draft_block_attention(**args)
    device = q.device
    ctx, ctx_host = _device_lengths("context_lens", context_lens, n, device)
    start, start_host = _device_lengths("start_positions", start_positions, n, device)
    page_size = k_cache.shape[1]
    if ctx_host is not None and n and max(ctx_host) > page_table.shape[1] * page_size:
        raise ValueError("a context is longer than max_pages * page_size positions")
    if ctx_host is not None and start_host is not None \
            and any(c > s for c, s in zip(ctx_host, start_host)):
        raise ValueError(f"context_lens {ctx_host} must not exceed start_positions {start_host}")
    out = torch.empty(n, b, h, d, dtype=q.dtype, device=device)
    if n == 0 or b == 0:
        return out
    table = page_table
    if table.device != device or table.dtype not in (torch.int32, torch.int64):
        table = table.to(device=device, dtype=torch.int32, non_blocking=True)
    q, block_k, block_v, k_cache, v_cache = map(_last_dim_contiguous,
                                                (q, block_k, block_v, k_cache, v_cache))

    group = h // kvh
    bp = triton.next_power_of_2(b)
    bd = max(16, triton.next_power_of_2(d))
    hpp = _heads_per_program(n, kvh, group, bp, _sm_count(device))
    rows = max(16, hpp * bp)  # tl.dot needs at least 16 rows
    grid = (n, kvh * triton.cdiv(group, hpp))
    _draft_attention_kernel[grid](
        q, block_k, block_v, k_cache, v_cache, table, ctx, start, out,
        *q.stride()[:3], *block_k.stride()[:3], *block_v.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3], *table.stride(), *out.stride()[:3],
        b, d, float(scale) * 1.4426950408889634,  # log2(e): the kernel uses exp2
        _NO_WINDOW if sliding_window is None else min(int(sliding_window), _NO_WINDOW),
        PAGE=page_size, G=group, HPP=hpp, M=rows, BP=bp, BKB=max(16, bp), BD=bd,
        BN=_key_block(bd * q.element_size()),
        CAUSAL=bool(causal), PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if rows * bd <= 64 * 128 else 8)
    return out
