"""Triton paged attention for CUDA graphs, planned without reading the lengths on the host.

A plan of :class:`TritonGraphAttention` is a buffer update and nothing else: each row's page
indices and length go into one pinned host buffer and reach the device in one copy that does
not wait for the GPU; the kernel (``common/ops/attention/paged_triton.py``) finds every row's
length there. FlashInfer's plan (``flashinfer_graph.py``) schedules its kernel from the lengths
on the host, a few hundred microseconds on the host before each replay; in a DFLASH step that
time falls between reading one step's acceptance and launching the next step's verify, where
the GPU has nothing to run. The number of key slices is fixed per batch size, so the grid is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import triton

from common.ops.attention import paged_triton
from common.ops.attention.planned import PinnedStaging, fixed_page_layout

__all__ = ["TritonGraphAttention", "graph_attention"]


def graph_attention(device: torch.device | str) -> Callable[..., "TritonGraphAttention"]:
    """The factory of one graph runner's attention plans (``common/ops/graph_capabilities.py``
    declares it for the ``triton`` backend). Plans share nothing, so it is the class itself."""
    return functools.partial(TritonGraphAttention, device=torch.device(device))


class TritonGraphAttention:
    """Attention of ``batch_size`` rows, each with ``q_len`` new tokens, over a paged cache.

    Args:
        batch_size: rows of every plan (the captured batch size, padding rows included).
        q_len: new tokens per row (1: decode; B: verify of a block of B).
        max_pages: most page indices a plan may hold (all rows together).
        longest: the most positions a row may have, where known: fewer key slices when rows
            are short (None: as many as fill the GPU).
    """

    def __init__(self, *, batch_size: int, q_len: int, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, max_pages: int, dtype: torch.dtype,
                 scale: float, device: torch.device, longest: int | None = None) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"query heads ({num_qo_heads}) must be a multiple of kv heads "
                             f"({num_kv_heads})")
        if head_dim > paged_triton.MAX_HEAD_DIM:
            raise ValueError(f"head dim {head_dim} is above the kernel's "
                             f"{paged_triton.MAX_HEAD_DIM}")
        self.batch_size, self.q_len, self.page_size = batch_size, q_len, page_size
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype, self.scale = dtype, scale
        group = num_qo_heads // num_kv_heads
        self.bq = triton.next_power_of_2(q_len)
        if self.bq * min(group, 4) > 64:
            raise ValueError(f"q_len {q_len} is too long for one program per row")
        chunks = triton.cdiv(group, paged_triton.heads_per_program(group, self.bq))
        self.splits = paged_triton.splits_for(batch_size, num_kv_heads, chunks, longest, device)
        # one int32 buffer: the rows' first page entry (indptr), length, and page indices;
        # the fixed parts (each row one item, its queries at r * q_len) are written once
        b = batch_size
        self.packed = torch.zeros(2 * b + 1 + max_pages, dtype=torch.int32, device=device)
        self.indptr, self.kv_len, self.indices = torch.split(self.packed, [b + 1, b, max_pages])
        rows = torch.arange(b, dtype=torch.int32, device=device)
        self.work_req, self.q_start = rows, rows * q_len
        self.work_q0 = torch.zeros(b, dtype=torch.int32, device=device)
        self.q_count = torch.full((b,), q_len, dtype=torch.int32, device=device)
        self._staging = PinnedStaging(device, 2 * b + 1, limit=self.packed.numel())

    def plan(self, page_ids: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> None:
        """Point the buffers at these rows: row r has ``seq_lens[r]`` tokens (its last
        ``q_len`` are the new ones) in its first pages of ``page_ids[r]``."""
        indptr, indices, _ = fixed_page_layout(
            page_ids, seq_lens, batch_size=self.batch_size, q_len=self.q_len,
            page_size=self.page_size, max_pages=self.indices.numel())
        b = self.batch_size
        used = 2 * b + 1 + len(indices)
        staged = self._staging.take(used)
        host = staged.numpy()
        host[:b + 1] = indptr
        host[b + 1:2 * b + 1] = seq_lens
        host[2 * b + 1:] = indices
        self.packed[:used].copy_(staged, non_blocking=True)
        self._staging.queued()

    def advance(self, n: int, delta: torch.Tensor) -> None:
        """Row r of the first ``n`` is ``delta[r]`` tokens longer than planned (shorter when
        negative), on the device: the plan of rows whose lengths the host has not read, made
        for their longest case (so it holds every page they may reach)."""
        self.kv_len[:n].add_(delta[:n].to(torch.int32))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """[batch_size * q_len, H, D] queries -> outputs of the same shape."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        return paged_triton.launch(
            q=q, k_cache=k_cache, v_cache=v_cache, out=torch.empty_like(q), table=self.indices,
            table_stride=1, row_start=self.indptr, work_req=self.work_req,
            work_q0=self.work_q0, q_start=self.q_start, q_count=self.q_count,
            kv_len=self.kv_len, bq=self.bq, splits=self.splits, scale=self.scale)
