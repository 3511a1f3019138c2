"""DFLASH draft block attention in plain torch, fast on the CPU: every request's block in one
batched matmul.

The reference (``draft_reference.draft_block_attention``) walks the requests one by one,
gathering each context position by page and offset and repeating keys and values for every
query head of a group. Here the contexts are gathered as whole pages for the batch at once
(``paged_cpu.gather_pages``), each request's block keys are appended after its padded context,
a group's query heads share their kv head through the matmul's rows, and one masked softmax
covers the batch. The numbers are the reference's to fp32 rounding (same fp32 scores, softmax
and sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.ops.attention.draft_reference import check_lengths, check_shapes
from common.ops.attention.paged_cpu import gather_pages

__all__ = ["draft_block_attention"]


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
    """Softmax attention of each request's B block queries over its context and block keys;
    the contract of ``draft_reference.draft_block_attention`` (same arguments, same result to
    fp32 rounding).

    Args:
        q: [N, B, H, D] block queries (RoPE applied).
        block_k, block_v: [N, B, KVH, D] the block's own keys / values; query head h reads kv
            head h // (H // KVH).
        k_cache, v_cache: [num_pages, page_size, KVH, D] this layer's context KV.
        page_table: [N, max_pages] integer page ids.
        context_lens: N ints, cached context tokens per request.
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
    if n == 0 or b == 0:
        return torch.empty_like(q)

    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    device = k_cache.device
    group = h // kvh
    # the block's own keys after each padded context
    keys, values, beyond = gather_pages(k_cache, v_cache, page_table, ctx, dt, extra=b)
    width = beyond.shape[1]
    for buffer, block in ((keys, block_k), (values, block_v)):
        buffer.view(n, kvh, width + b, d)[:, :, width:].copy_(block.to(device).transpose(1, 2))

    # key positions [N, width + B]: the context's, then the block's own
    starts = torch.tensor(start, device=device)
    step = torch.arange(b, device=device)
    k_pos = torch.cat([torch.arange(width, device=device).expand(n, width),
                       starts[:, None] + step], dim=1)
    delta = (starts[:, None] + step)[:, :, None] - k_pos[:, None, :]  # [N, B, width + B]
    hidden = torch.cat([beyond, torch.zeros(n, b, dtype=torch.bool, device=device)],
                       dim=1)[:, None, :].expand(n, b, width + b)
    if causal:
        hidden = hidden | (delta < 0)
    if sliding_window is not None:
        hidden = hidden | (delta >= sliding_window)
        if not causal:
            hidden = hidden | (-delta >= sliding_window)

    # [N, B, KVH, G, D] -> [N*KVH, G*B, D]
    queries = q.to(dt).view(n, b, kvh, group, d).permute(0, 2, 3, 1, 4).reshape(n * kvh,
                                                                               group * b, d)
    scores = torch.bmm(queries, keys.transpose(1, 2)).mul_(scale)
    scores = scores.view(n, kvh, group, b, width + b).masked_fill_(hidden[:, None, None],
                                                                   float("-inf"))
    probs = torch.softmax(scores.view(n * kvh, group * b, width + b), dim=-1)
    o = torch.bmm(probs, values).view(n, kvh, group, b, d).permute(0, 3, 1, 2, 4)
    return o.reshape(n, b, h, d).to(q.dtype)
