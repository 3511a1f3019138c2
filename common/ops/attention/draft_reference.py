"""Plain-torch attention of a DFLASH draft block over its request's paged context KV plus the
block's own keys (which are not cached)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.ops.attention.reference import as_lengths

__all__ = ["check_lengths", "check_shapes", "draft_block_attention"]


def check_shapes(*, q, block_k, block_v, k_cache, v_cache, page_table,
                 sliding_window) -> tuple[int, int, int, int, int]:
    """The shape rules of :func:`draft_block_attention` (no tensor values are read).

    Returns (N, B, H, D, KVH); ValueError naming the offending argument otherwise.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [N, B, H, D], got {tuple(q.shape)}")
    n, b, h, d = q.shape
    if block_k.dim() != 4 or block_k.shape[:2] != (n, b) or block_k.shape[3] != d \
            or block_v.shape != block_k.shape:
        raise ValueError(f"block_k and block_v must both be [{n}, {b}, KVH, {d}], got "
                         f"{tuple(block_k.shape)} and {tuple(block_v.shape)}")
    kvh = block_k.shape[2]
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != (kvh, d):
        raise ValueError(f"k_cache and v_cache must both be [pages, page_size, {kvh}, {d}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != n or page_table.is_floating_point():
        raise ValueError(f"page_table must be an integer [{n}, max_pages] tensor, got "
                         f"{tuple(page_table.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    return n, b, h, d, kvh


def check_lengths(context_lens: Sequence[int] | torch.Tensor,
                  start_positions: Sequence[int] | torch.Tensor, page_table: torch.Tensor,
                  page_size: int) -> tuple[list[int], list[int]]:
    """The length rules of :func:`draft_block_attention` (read on the host): one context length
    and one block start per page-table row, each context within the row's pages and not past
    its block's start. Returns (context_lens, start_positions) as ints."""
    n, max_pages = page_table.shape
    ctx = as_lengths("context_lens", context_lens, n)
    start = as_lengths("start_positions", start_positions, n)
    if n and max(ctx) > max_pages * page_size:
        raise ValueError("a context is longer than max_pages * page_size positions")
    if any(c > s for c, s in zip(ctx, start)):
        raise ValueError(f"context_lens {ctx} must not exceed start_positions {start}")
    return ctx, start


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
    """Softmax attention of each request's B block queries over its context and block keys.

    Request r's keys are its cached context at positions ``0 .. context_lens[r]-1`` (position p
    at ``[page_table[r, p // page_size], p % page_size]``) followed by its B block keys at
    positions ``start_positions[r] .. start_positions[r]+B-1``; block query i sits at position
    ``start_positions[r] + i``. A query at position qp sees a key at kp when
    ``(not causal or kp <= qp)`` and, with a window W, ``qp - kp < W`` (and ``kp - qp < W``
    when not causal), as z-lab's reference DFlash attention does.

    Args:
        q: [N, B, H, D] block queries (RoPE applied).
        block_k, block_v: [N, B, KVH, D] the block's own keys / values; query head h reads kv
            head h // (H // KVH).
        k_cache, v_cache: [num_pages, page_size, KVH, D] this layer's context KV.
        page_table: [N, max_pages] integer page ids.
        context_lens: N ints, cached context tokens per request (usually = start_positions).
        start_positions: N ints, position of each block's first token.
        scale: multiplies q.k before the softmax.
        causal: mask keys after the query.
        sliding_window: keys at most this many positions away (the query's own included).

    Returns:
        o: [N, B, H, D] in q.dtype; scores, softmax and sum in fp32 (fp64 for fp64 q).
    """
    n, b, h, d, kvh = check_shapes(q=q, block_k=block_k, block_v=block_v, k_cache=k_cache,
                                   v_cache=v_cache, page_table=page_table,
                                   sliding_window=sliding_window)
    ctx, start = check_lengths(context_lens, start_positions, page_table, k_cache.shape[1])
    num_pages, page_size = k_cache.shape[:2]

    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = h // kvh
    out = torch.empty_like(q)
    for r in range(n):
        pos = torch.arange(ctx[r], device=k_cache.device)
        pages = page_table[r].to(device=k_cache.device, dtype=torch.long)[pos // page_size]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
            raise ValueError(f"page_table row {r} points outside the {num_pages} cache pages")
        keys = torch.cat([k_cache[pages, pos % page_size], block_k[r].to(k_cache.device)])
        values = torch.cat([v_cache[pages, pos % page_size], block_v[r].to(v_cache.device)])
        keys = keys.to(dt).repeat_interleave(group, dim=1)  # [ctx + B, H, D]
        values = values.to(dt).repeat_interleave(group, dim=1)
        k_pos = torch.cat([pos, start[r] + torch.arange(b, device=pos.device)])
        q_pos = start[r] + torch.arange(b, device=pos.device)
        delta = q_pos[:, None] - k_pos[None, :]  # [B, ctx + B]
        visible = torch.ones_like(delta, dtype=torch.bool)
        if causal:
            visible &= delta >= 0
        if sliding_window is not None:
            visible &= delta < sliding_window
            if not causal:
                visible &= -delta < sliding_window
        scores = torch.einsum("qhd,khd->hqk", q[r].to(dt), keys) * scale
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[r] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
