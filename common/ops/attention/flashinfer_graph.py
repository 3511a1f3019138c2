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
from common.ops.attention.planned import PinnedStaging, fixed_page_layout

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
        # A plan's page description is written to pinned host memory, and its page indices
        # are copied into ``indices`` here, without waiting: given host indices the wrapper
        # copies them with a blocking copy, a stream synchronisation, so the host would wait
        # there for every kernel queued before the plan (a verify's draft, or the step before
        # under overlap scheduling) and the GPU would then idle through the rest of the plan.
        self._staging = PinnedStaging(device, 2 * batch_size + 1,
                                      limit=2 * batch_size + 1 + max_pages)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            float_workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=(decode_uses_tensor_cores(num_qo_heads, num_kv_heads, q_len)
                              if tensor_cores is None else tensor_cores),
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len, backend="fa2")

    def plan(self, page_ids: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> None:
        """Point the buffers at these rows: row r has ``seq_lens[r]`` tokens (its last
        ``q_len`` are the new ones) in its first pages of ``page_ids[r]``."""
        indptr, indices, last = fixed_page_layout(
            page_ids, seq_lens, batch_size=self.batch_size, q_len=self.q_len,
            page_size=self.page_size, max_pages=self.indices.numel())
        n, b = len(indices), self.batch_size
        staged = self._staging.take(2 * b + 1 + n)
        host_indptr, host_last, host_indices = torch.split(staged, [b + 1, b, n])
        host_indptr.numpy()[:] = indptr
        host_last.numpy()[:] = last
        host_indices.numpy()[:] = indices
        self.indices[:n].copy_(host_indices, non_blocking=True)
        h, kvh, d = self.heads
        # the wrapper plans from the rows' lengths on the host; its own copy of the indices
        # (into the buffer they are already in) is left out by torch as a copy onto itself
        self.wrapper.plan(host_indptr, self.indices[:n], host_last, h, kvh, d,
                          self.page_size, q_data_type=self.dtype, kv_data_type=self.dtype,
                          sm_scale=self.scale, q_len_per_req=self.q_len, non_blocking=True)
        self._staging.queued()

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """[batch_size * q_len, H, D] queries -> outputs of the same shape."""
        q = q if q.is_contiguous() else q.contiguous()
        return self.wrapper.run(q, (k_cache, v_cache))
