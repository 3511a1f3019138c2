"""Triton paged attention whose lengths may live on the device, with the keys split across programs.

Same contract as :func:`common.ops.attention.reference.paged_attention` (causal attention of
each request's new tokens over all of its cached positions). What it adds is the launch
:func:`launch`, which CUDA-graph plans (``common/ops/attention/triton_graph.py``) call with
every length in device buffers: the grid depends on shapes only, no value is read on the host,
so nothing has to be planned on the host before a replay. FlashInfer's plan reads the rows'
lengths on the host to schedule its kernel, and a speculative step's verify waits for it.

One program takes one *work item* (a request and up to ``BQ`` of its new tokens), a group of
query heads sharing one kv head (rows are (head, query) pairs), and one of ``SPLITS`` equal
slices of the keys the item can see: decode and verify have one or a few tokens per request, so
at a small batch the keys, not the queries, are what spreads the work over the GPU (split-KV,
as FlashInfer's decode and SGLang's Triton decode kernels do). With several splits each slice
writes its normalised output and log-sum-exp to a workspace and :func:`_combine_kernel` merges
them. Scores accumulate in fp32; fp32 inputs use IEEE fp32 dots (not tf32) so the result agrees
with the reference to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from common.ops.attention import reference
from common.ops.attention.draft_triton import _attend, _key_block, _sm_count, _supported

__all__ = ["MAX_HEAD_DIM", "heads_per_program", "launch", "paged_attention", "splits_for"]

_MAX_ROWS = 64  # (head, query) rows per program
MAX_HEAD_DIM = 256
_MAX_SPLITS = 32
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q, kc, vc, table, row_start, work_req, work_q0, q_start, q_count, kv_len, o, part_o, part_lse,
    sq_t, sq_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, page_step, so_t, so_h,
    H, D, qk_scale,
    PAGE: tl.constexpr, G: tl.constexpr, HPP: tl.constexpr, BQ: tl.constexpr, M: tl.constexpr,
    BD: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr,
):
    w = tl.program_id(0)
    chunks = (G + HPP - 1) // HPP  # programs per kv head (constexpr)
    kvh = tl.program_id(1) // chunks
    split = tl.program_id(2)
    r = tl.load(work_req + w)
    q0 = tl.load(work_q0 + w)
    count = tl.load(q_count + r)
    total = tl.load(kv_len + r)
    first_token = tl.load(q_start + r) + q0

    rows = tl.arange(0, M)
    qi = rows % BQ  # query of the row within the item
    hg = (tl.program_id(1) % chunks) * HPP + rows // BQ  # query head within the kv head's group
    row_ok = (q0 + qi < count) & (rows // BQ < HPP) & (hg < G)
    head = kvh * G + hg
    token = (first_token + qi).to(tl.int64)
    qp = total - count + q0 + qi  # the row's position
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    qt = tl.load(q + token[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, BD], dtype=tl.float32)

    # the keys this item's last query sees, cut into SPLITS slices of whole key blocks
    seen = tl.minimum(total, total - count + q0 + BQ)
    per = tl.cdiv(tl.cdiv(seen, SPLITS), BN) * BN
    lo = split * per
    hi = tl.minimum(lo + per, seen)
    base = tl.load(row_start + r).to(tl.int64)
    for k0 in range(lo, hi, BN):
        kp = k0 + tl.arange(0, BN)
        k_ok = kp < hi
        # int64 page ids: page * page stride overflows int32 in large pools
        page = tl.load(table + base + (kp // PAGE) * page_step, mask=k_ok, other=0).to(tl.int64)
        slot = kp % PAGE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        kt = tl.load(kc + page[:, None] * skc_p + slot[:, None] * skc_s + kvh * skc_h
                     + offs_d[None, :], mask=kv_mask, other=0.0)
        vt = tl.load(vc + page[:, None] * svc_p + slot[:, None] * svc_s + kvh * svc_h
                     + offs_d[None, :], mask=kv_mask, other=0.0)
        # (no sliding window: a distance no position reaches)
        m_i, l_i, acc = _attend(qt, kt, vt, qp, kp, k_ok, m_i, l_i, acc, qk_scale, 1 << 30,
                                True, PREC)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        # one slice holds every visible key: each real row saw its own
        tl.store(o + token[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
                 out.to(o.dtype.element_ty), mask=o_mask)
    else:
        # a slice with no visible key leaves lse = -inf, which the combine weighs as zero
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        cell = token * H + head  # the (token, head) row of the workspace
        tl.store(part_o + (cell[:, None] * SPLITS + split) * BD + offs_d[None, :], out,
                 mask=o_mask)
        tl.store(part_lse + cell * SPLITS + split, lse, mask=row_ok)


@triton.jit
def _combine_kernel(part_o, part_lse, o, so_t, so_h, H, D,
                    SPLITS: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
    """One (token, head): the softmax-weighted sum of its slices' outputs (log2 domain)."""
    cell = tl.program_id(0).to(tl.int64)
    token, head = cell // H, cell % H
    s = tl.arange(0, BS)
    s_ok = s < SPLITS
    offs_d = tl.arange(0, BD)
    lse = tl.load(part_lse + cell * SPLITS + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    part = tl.load(part_o + (cell * SPLITS + s[:, None]) * BD + offs_d[None, :],
                   mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(o + token * so_t + head * so_h + offs_d, out.to(o.dtype.element_ty),
             mask=offs_d < D)


def splits_for(work_items: int, kv_heads: int, head_chunks: int, longest: int | None,
               device: torch.device) -> int:
    """Key slices per item: enough programs to fill the GPU twice over, none shorter than
    256 keys when the longest row is known (a short row's extra slices are empty work)."""
    programs = max(1, work_items * kv_heads * head_chunks)
    splits = max(1, min(_MAX_SPLITS, 2 * _sm_count(device) // programs))
    if longest is not None:
        splits = max(1, min(splits, triton.cdiv(longest, 256)))
    return splits


def heads_per_program(group: int, bq: int) -> int:
    """Query heads one program takes (a power of two): the whole group while its rows fit."""
    return max(1, min(triton.next_power_of_2(group), _MAX_ROWS // bq))


def launch(*, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           out: torch.Tensor, table: torch.Tensor, table_stride: int, row_start: torch.Tensor,
           work_req: torch.Tensor, work_q0: torch.Tensor, q_start: torch.Tensor,
           q_count: torch.Tensor, kv_len: torch.Tensor, bq: int, splits: int,
           scale: float) -> torch.Tensor:
    """Run the kernels over the work items (every index argument an int32 device tensor; none
    is read on the host, so a CUDA graph can capture the call).

    Item w covers new tokens ``work_q0[w] .. work_q0[w] + bq - 1`` of request ``work_req[w]``,
    whose new tokens are rows ``q_start[r] ..`` of ``q`` (``q_count[r]`` of them, the last of
    its ``kv_len[r]`` positions). Page p of request r is ``table[row_start[r] + p *
    table_stride]``. Writes ``out`` [T, H, D] and returns it.
    """
    t, h, d = q.shape
    kvh, page_size = k_cache.shape[2], k_cache.shape[1]
    group = h // kvh
    hpp = heads_per_program(group, bq)
    chunks = triton.cdiv(group, hpp)
    bd = max(16, triton.next_power_of_2(d))
    rows = max(16, hpp * bq)  # tl.dot needs at least 16 rows
    items = work_req.numel()
    if items == 0 or t == 0:
        return out
    if splits > 1:
        part_o = torch.empty(t * h * splits * bd, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(t * h * splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # not read
    _paged_attention_kernel[(items, kvh * chunks, splits)](
        q, k_cache, v_cache, table, row_start, work_req, work_q0, q_start, q_count, kv_len, out,
        part_o, part_lse, q.stride(0), q.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], table_stride, out.stride(0), out.stride(1),
        h, d, float(scale) * _LOG2E,
        PAGE=page_size, G=group, HPP=hpp, BQ=bq, M=rows, BD=bd,
        BN=_key_block(bd * q.element_size()), SPLITS=splits,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if rows * bd <= 64 * 128 else 8)
    if splits > 1:
        _combine_kernel[(t * h,)](part_o, part_lse, out, out.stride(0), out.stride(1), h, d,
                                  SPLITS=splits, BS=max(2, triton.next_power_of_2(splits)),
                                  BD=bd)
    return out


def paged_attention(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: Sequence[int] | torch.Tensor,
    extend_lens: Sequence[int] | torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton version of :func:`common.ops.attention.reference.paged_attention` (same contract;
    lengths are read on the host here, to cut each request's new tokens into items).

    CPU tensors (unless TRITON_INTERPRET=1), fp64, mixed dtypes and head dims above 256 go to
    the reference.
    """
    prefix, extend = reference.check_paged(q, k_cache, v_cache, page_table, prefix_lens,
                                           extend_lens)
    if not _supported(q, k_cache, v_cache) or q.shape[2] > MAX_HEAD_DIM:
        return reference.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache,
                                         page_table=page_table, prefix_lens=prefix,
                                         extend_lens=extend, scale=scale)
    device = q.device
    n = len(extend)
    h, kvh = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    longest_new = max(extend, default=0)
    if longest_new == 0:
        return out
    # decode and verify: every query of a request in one item, the group's heads together;
    # longer extends: items of up to 64 queries of one head
    bq = triton.next_power_of_2(longest_new) if longest_new * min(h // kvh, 4) <= _MAX_ROWS \
        else _MAX_ROWS
    starts = [0]
    for e in extend:
        starts.append(starts[-1] + e)
    work = [(r, q0) for r, e in enumerate(extend) for q0 in range(0, e, bq)]
    table = page_table
    if table.device != device or table.dtype != torch.int32 or table.stride(1) != 1:
        table = table.to(device=device, dtype=torch.int32).contiguous()
    meta = torch.tensor(
        [[table.stride(0) * r for r in range(n)], starts[:n], extend,
         [p + e for p, e in zip(prefix, extend)]], dtype=torch.int32)
    items = torch.tensor(work, dtype=torch.int32).T.contiguous()
    meta, items = meta.to(device, non_blocking=True), items.to(device, non_blocking=True)
    chunks = triton.cdiv(h // kvh, heads_per_program(h // kvh, bq))
    splits = splits_for(len(work), kvh, chunks, max(p + e for p, e in zip(prefix, extend)),
                        device) if longest_new <= 16 else 1
    return launch(q=q if q.stride(-1) == 1 else q.contiguous(), k_cache=k_cache,
                  v_cache=v_cache, out=out, table=table, table_stride=1, row_start=meta[0],
                  work_req=items[0], work_q0=items[1], q_start=meta[1], q_count=meta[2],
                  kv_len=meta[3], bq=bq, splits=splits, scale=scale)
