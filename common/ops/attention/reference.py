"""Plain-torch causal attention of packed new tokens over a paged KV cache (prefill, chunked prefill, decode)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["as_lengths", "check_paged", "paged_attention"]


def as_lengths(name: str, value: Sequence[int] | torch.Tensor, n: int) -> list[int]:
    """Per-request lengths as ints; ValueError unless there are ``n`` of them, none negative."""
    values = [int(x) for x in (value.tolist() if isinstance(value, torch.Tensor) else value)]
    if len(values) != n or any(x < 0 for x in values):
        raise ValueError(f"{name} must hold {n} non-negative lengths, got {values}")
    return values


def check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                page_table: torch.Tensor, prefix_lens: Sequence[int] | torch.Tensor,
                extend_lens: Sequence[int] | torch.Tensor) -> tuple[list[int], list[int]]:
    """The argument rules of :func:`paged_attention`; returns (prefix_lens, extend_lens) as
    ints."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [pages, page_size, KVH, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    t, h, d = q.shape
    _, page_size, kvh, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head dim of q ({d}) and of the cache ({dk}) differ")
    if h % kvh != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    if page_table.dim() != 2 or page_table.is_floating_point():
        raise ValueError(f"page_table must be an integer [N, max_pages] tensor, got {tuple(page_table.shape)}")
    n, max_pages = page_table.shape
    prefix = as_lengths("prefix_lens", prefix_lens, n)
    extend = as_lengths("extend_lens", extend_lens, n)
    if sum(extend) != t:
        raise ValueError(f"sum(extend_lens) = {sum(extend)} but q has {t} tokens")
    if n and max(p + e for p, e in zip(prefix, extend)) > max_pages * page_size:
        raise ValueError(f"a request needs more than max_pages * page_size = {max_pages * page_size} positions")
    return prefix, extend


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
    """Causal softmax attention of each request's new tokens over all of its cached positions.

    Request r owns ``extend_lens[r]`` consecutive rows of q, at positions ``prefix_lens[r] ..
    prefix_lens[r] + extend_lens[r] - 1``; the query at position p attends to keys 0..p. Position p
    of request r lives at ``[page_table[r, p // page_size], p % page_size]`` of the caches, which must
    already hold K/V for every position up to the request's last new token.

    Args:
        q: [T, H, D] packed queries, T = sum(extend_lens).
        k_cache, v_cache: [num_pages, page_size, KVH, D]; query head h reads kv head h // (H // KVH).
        page_table: [N, max_pages] integer page ids.
        prefix_lens, extend_lens: N ints (python list or CPU integer tensor).
        scale: multiplies q.k before the softmax.

    Returns:
        o: [T, H, D] in q.dtype. Scores, softmax and the weighted sum run in fp32 (fp64 for fp64 q).
    """
    prefix, extend = check_paged(q, k_cache, v_cache, page_table, prefix_lens, extend_lens)
    t, h, d = q.shape
    num_pages, page_size, kvh, _ = k_cache.shape
    n = page_table.shape[0]

    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = h // kvh
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    start = 0
    for r in range(n):
        total, new = prefix[r] + extend[r], extend[r]
        if new == 0:
            continue
        pos = torch.arange(total, device=k_cache.device)
        pages = page_table[r].to(device=k_cache.device, dtype=torch.long)[pos // page_size]
        if int(pages.min()) < 0 or int(pages.max()) >= num_pages:
            raise ValueError(f"page_table row {r} points outside the {num_pages} cache pages")
        # Gather this request's keys into one contiguous [total, H, D] block (GQA via repeat_interleave).
        keys = k_cache[pages, pos % page_size].to(dt).repeat_interleave(group, dim=1)
        values = v_cache[pages, pos % page_size].to(dt).repeat_interleave(group, dim=1)
        queries = q[start : start + new].to(dt)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale  # [H, new, total]
        q_pos = torch.arange(prefix[r], total, device=q.device)
        scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + new] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        start += new
    return out
