"""Paged attention in plain torch, fast on the CPU: every request in one batched matmul.

The reference (``reference.paged_attention``) walks the requests one by one, repeats each
request's keys and values for every query head of a group, and reads the page range on the host
twice per request. Here the batch's keys and values are gathered as whole pages, once
(:func:`gather_pages`: L the longest request's positions; a shorter request's extra positions
are masked, their values zeroed), a group's query heads share their kv head through the
matmul's rows instead of a copy, and one masked softmax covers the batch. The numbers are the
reference's to fp32 rounding (same fp32 scores, softmax and sum).

A batch whose padding would cost more than the work (one long prefill beside short rows) runs
request by request through the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.ops.attention.reference import check_paged
from common.ops.padded_block import padded

__all__ = ["gather_pages", "paged_attention"]

# the most padded score entries the batched form may compute per useful one before a batch is
# cheaper request by request
_PADDING_LIMIT = 2.0


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
    """Causal attention of each request's new tokens over its cached positions; the contract
    of ``reference.paged_attention`` (same arguments, same result to fp32 rounding).

    Args:
        q: [T, H, D] packed queries, T = sum(extend_lens).
        k_cache, v_cache: [num_pages, page_size, KVH, D]; query head h reads kv head
            h // (H // KVH).
        page_table: [N, max_pages] integer page ids (only the pages a request's positions use
            are read).
        prefix_lens, extend_lens: N ints (python list or CPU integer tensor).
        scale: multiplies q.k before the softmax.

    Returns:
        o: [T, H, D] in q.dtype; scores, softmax and the weighted sum in fp32 (fp64 for fp64 q).
    """
    prefix, extend = check_paged(q, k_cache, v_cache, page_table, prefix_lens, extend_lens)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rows = [r for r, e in enumerate(extend) if e]
    if not rows:
        return out
    totals = [prefix[r] + extend[r] for r in rows]
    entries = len(rows) * max(extend[r] for r in rows) * max(totals)
    useful = sum(extend[r] * total for r, total in zip(rows, totals))
    starts = [sum(extend[:r]) for r in rows]
    groups = [rows] if entries <= _PADDING_LIMIT * useful else [[r] for r in rows]
    for group in groups:
        first = starts[rows.index(group[0])]
        count = sum(extend[r] for r in group)
        # a group is a run of consecutive requests, so its queries are consecutive rows
        out[first:first + count] = _batched(
            q[first:first + count], k_cache, v_cache, page_table[group],
            [prefix[r] for r in group], [extend[r] for r in group], scale)
    return out


def _batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             page_table: torch.Tensor, prefix: list[int], extend: list[int],
             scale: float) -> torch.Tensor:
    """Attention of requests that all have new tokens, padded to the longest; [T, H, D]."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    group = h // kvh
    n, new = len(extend), max(extend)
    device = k_cache.device
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32

    lens = [p + e for p, e in zip(prefix, extend)]
    keys, values, beyond = gather_pages(k_cache, v_cache, page_table, lens, dt)
    total = beyond.shape[1]

    if new == 1:
        queries = q.to(dt).view(n, kvh, group, d)
    else:
        index, real = padded(extend, q.device)  # request r's token i at row i of its block
        block = q if index is None else q[index]
        # [N, new, KVH, G, D] -> [N, KVH, G, new, D]
        queries = block.to(dt).view(n, new, kvh, group, d).permute(0, 2, 3, 1, 4)
    queries = queries.reshape(n * kvh, group * new, d)

    scores = torch.bmm(queries, keys.transpose(1, 2)).mul_(scale)  # [N*KVH, G*new, L]
    # query i of request r sits at position prefix_r + i and sees keys 0..that position (for
    # one new token, every position before the request's end)
    if new == 1:
        hidden = beyond[:, None]
    else:
        q_pos = torch.tensor(prefix, device=device)[:, None] + torch.arange(new, device=device)
        hidden = torch.arange(total, device=device)[None, None, :] > q_pos[:, :, None]
    scores = scores.view(n, kvh, group, new, total).masked_fill_(
        hidden[:, None, None], float("-inf"))
    probs = torch.softmax(scores.view(n * kvh, group * new, total), dim=-1)
    o = torch.bmm(probs, values).view(n, kvh, group, new, d)
    if new == 1:
        return o.view(n, h, d).to(q.dtype)
    o = o.permute(0, 3, 1, 2, 4).reshape(n * new, h, d)
    return (o if real is None else o[real.flatten()]).to(q.dtype)


def gather_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 lens: list[int], dtype: torch.dtype, extra: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``lens[r]`` cached positions of every request r, padded to whole pages of the
    longest: keys and values ``[N*KVH, L + extra, D]`` in ``dtype`` (one (request, kv head)
    per matmul batch entry; the last ``extra`` rows left for the caller to fill) and
    ``beyond`` ``[N, L]``, True at the padding positions.

    Whole pages are gathered by one ``index_select`` each (a page is one contiguous block of the
    cache); page slots a request does not use read page 0. Values at padding positions are 0:
    they get weight 0, and 0 times whatever a stale or scratch page holds could be a NaN.
    ValueError if a page a request uses is not in the cache.
    """
    num_pages, page_size, kvh, d = k_cache.shape
    n, device = len(lens), k_cache.device
    width = max(-(-length // page_size) for length in lens)
    total = width * page_size
    beyond = (torch.arange(total, device=device)[None, :]
              >= torch.tensor(lens, device=device)[:, None])
    used = ~beyond[:, ::page_size]  # [N, width]: a page is used when its first position is
    pages = torch.where(used, page_table[:, :width].to(device=device, dtype=torch.long), 0)
    low, high = torch.aminmax(pages) if width else (0, 0)
    if int(low) < 0 or int(high) >= num_pages:
        raise ValueError(f"the page table points outside the {num_pages} cache pages")
    pages = pages.flatten()
    out = []
    for cache, stale_to_zero in ((k_cache, False), (v_cache, True)):
        gathered = cache.index_select(0, pages).view(n, total, kvh, d)
        if stale_to_zero:
            gathered.view(n * total, kvh * d).index_fill_(
                0, beyond.flatten().nonzero().flatten(), 0)
        # one copy converts and lays out: [N, L, KVH, D] -> [N, KVH, L (+ extra), D]
        buffer = torch.empty(n, kvh, total + extra, d, dtype=dtype, device=device)
        buffer[:, :, :total].copy_(gathered.transpose(1, 2))
        out.append(buffer.view(n * kvh, total + extra, d))
    return out[0], out[1], beyond
