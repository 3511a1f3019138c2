"""FlashInfer paged attention for CUDA graphs: fixed batch size, indices in fixed device buffers.

FlashInfer's decode wrapper in CUDA-graph mode (``use_cuda_graph=True``) reads the ragged page
description (indptr, page indices, last-page lengths) from buffers we own, so a graph captured
once replays for any pages and lengths after :meth:`FlashInferGraphAttention.plan` refreshes them.
The same wrapper serves speculative verification: with tensor cores and ``q_len_per_req = B``
it runs B queries per request, causal and aligned with the end of each row's KV (query i of a row
with L tokens sees keys 0..L-B+i), which is exactly the VERIFY mask.

The backend is pinned to FlashInfer's ``fa2`` kernels: ``auto`` may pick a different kernel per
shape, and a captured graph must keep the kernel it was captured with.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from common.ops.attention.flashinfer import decode_uses_tensor_cores
from common.ops.attention.planned import page_layout

__all__ = ["FlashInferGraphAttention", "graph_attention", "workspace"]

_WORKSPACE_BYTES = 256 * 1024 * 1024


def workspace(device: torch.device | str) -> torch.Tensor:
    """A zeroed float workspace for FlashInfer's split-KV partial results. Wrappers whose runs
    never overlap (graphs replayed one after another on one stream) may share one."""
    return torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def graph_attention(device: torch.device | str) -> Callable[..., "FlashInferGraphAttention"]:
    """The factory of one graph runner's attention plans (``common/ops/graph_capabilities.py``
    declares it for the ``flashinfer`` backend): :class:`FlashInferGraphAttention` with every
    other argument given per plan, all sharing one new :func:`workspace` on ``device`` (a
    runner replays its graphs one after another on one stream)."""
    return functools.partial(FlashInferGraphAttention, float_workspace=workspace(device))


class FlashInferGraphAttention:
    """Attention of ``batch_size`` rows, each with ``q_len`` new tokens, over a paged cache.

    Args:
        batch_size: rows of every plan (the captured batch size, padding rows included).
        q_len: new tokens per row (1: decode; B: verify of a block of B).
        max_pages: most page indices a plan may hold (all rows together).
        float_workspace: from :func:`workspace`.
        tensor_cores: FlashInfer's tensor-core decode kernel (default: ``decode_uses_tensor_cores``).
    """

    def __init__(self, *, batch_size: int, q_len: int, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, max_pages: int, dtype: torch.dtype,
                 scale: float, float_workspace: torch.Tensor,
                 tensor_cores: bool | None = None) -> None:
        import flashinfer

        device = float_workspace.device
        self.batch_size, self.q_len, self.page_size = batch_size, q_len, page_size
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype, self.scale = dtype, scale
        self.indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(batch_size, dtype=torch.int32, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            float_workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=(decode_uses_tensor_cores(num_qo_heads, num_kv_heads, q_len)
                              if tensor_cores is None else tensor_cores),
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len, backend="fa2")

    def plan(self, page_ids: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> None:
        """Point the buffers at these rows: row r has ``seq_lens[r]`` tokens (its last
        ``q_len`` are the new ones) in its first pages of ``page_ids[r]``."""
        if len(seq_lens) != self.batch_size:
            raise ValueError(f"a plan of this wrapper has {self.batch_size} rows, got "
                             f"{len(seq_lens)}")
        if any(s < self.q_len for s in seq_lens):
            raise ValueError(f"every row needs at least q_len = {self.q_len} tokens")
        indptr, indices, last = page_layout(page_ids, seq_lens, self.page_size)
        if len(indices) > self.indices.numel():
            raise ValueError(f"{len(indices)} pages exceed the plan's {self.indices.numel()}")
        h, kvh, d = self.heads
        self.wrapper.plan(torch.tensor(indptr, dtype=torch.int32),
                          torch.tensor(indices, dtype=torch.int32),
                          torch.tensor(last, dtype=torch.int32), h, kvh, d, self.page_size,
                          q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
                          q_len_per_req=self.q_len, non_blocking=True)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """[batch_size * q_len, H, D] queries -> outputs of the same shape."""
        q = q if q.is_contiguous() else q.contiguous()
        return self.wrapper.run(q, (k_cache, v_cache))
