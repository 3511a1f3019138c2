"""FlashInfer paged attention with the contract of ``common.ops.attention.reference.paged_attention``.

Our KV pool keeps, per layer, K and V as ``[num_pages, page_size, kv_heads, head_dim]`` views of one
``[num_pages, 2, page_size, kv_heads, head_dim]`` tensor: FlashInfer's NHD layout. FlashInfer reads
such strided views directly (its own 5-D form unbinds to the same views), so nothing is copied.

Each call builds the ragged page indices from ``page_table`` / ``prefix_lens`` / ``extend_lens`` and
plans a wrapper (CUDA-graph wrappers with fixed buffers are a separate, later concern):

- ``qo_indptr``: offsets of each request's new tokens in q;
- ``kv_indptr`` / ``kv_indices``: the first ``ceil((prefix + extend) / page_size)`` pages of each
  row of ``page_table``, concatenated;
- ``kv_last_page_len``: tokens used in each request's last page (1..page_size).

FlashInfer's causal mask aligns the new tokens with the *end* of the KV sequence (query i of a
request with kv_len L and qo_len n sees keys 0..L-n+i), which is exactly "new tokens at positions
prefix..prefix+extend-1 see everything up to themselves".

Batches where every request has one new token (decode) go to the decode wrapper; anything else to
the prefill wrapper. Unsupported inputs (CPU tensors, fp32/fp64, head dims other than 64/128/256,
mismatched q/KV dtypes) go to the reference implementation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from common.ops.attention import reference

__all__ = ["paged_attention", "supports", "decode_uses_tensor_cores", "require", "PREFILL_BACKEND"]

# FlashInfer prefill backend; fa3 is the Hopper kernel, "auto" lets FlashInfer choose.
PREFILL_BACKEND = os.environ.get("FLASHSPLIT_FLASHINFER_PREFILL_BACKEND", "fa3")
_WORKSPACE_BYTES = 256 * 1024 * 1024
_HEAD_DIMS = (64, 128, 256)

_workspaces: dict[torch.device, torch.Tensor] = {}
_wrappers: dict[tuple[str, torch.device, bool], object] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def require() -> None:
    """ImportError unless FlashInfer imports. The registry calls it when this backend is chosen:
    this module imports FlashInfer inside its functions (its helpers serve machines without
    it), so without the check a missing FlashInfer surfaced only at the first attention call."""
    import flashinfer  # noqa: F401


def decode_uses_tensor_cores(num_qo_heads: int, num_kv_heads: int, q_len: int = 1) -> bool:
    """FlashInfer's decode wrapper runs its tensor-core (prefill) kernel for verify blocks and
    for groups of 4+ query heads per KV head: its CUDA-core kernel walks a short KV serially
    per head and was slower at every graphed shape measured on H200, 1.05-2.5x
    (``benchmarks/decode_attention.py``, docs/performance.md).
    SGLang applies the same group-size rule."""
    return q_len > 1 or num_qo_heads // num_kv_heads >= 4


def _wrapper(kind: str, device: torch.device, tensor_cores: bool = False):
    key = (kind, device, tensor_cores)
    if key not in _wrappers:
        import flashinfer

        if kind == "prefill":
            _wrappers[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                _workspace(device), "NHD", backend=PREFILL_BACKEND)
        else:
            _wrappers[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                _workspace(device), "NHD", use_tensor_cores=tensor_cores)
    return _wrappers[key]


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether FlashInfer serves these inputs (else the reference runs)."""
    return (q.is_cuda and k_cache.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and k_cache.dtype == q.dtype and q.shape[-1] in _HEAD_DIMS
            and q.shape[-1] == k_cache.shape[-1] and k_cache.stride(-1) == 1
            and q.shape[1] % k_cache.shape[2] == 0)


def page_indices(page_table: torch.Tensor, seq_lens: Sequence[int], page_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's ragged page description of requests with ``seq_lens`` cached+new tokens.

    Returns:
        kv_indptr [N+1] int32 (CPU), kv_indices [sum pages] int32 (page_table's device),
        kv_last_page_len [N] int32 (CPU).
    """
    n, max_pages = page_table.shape
    pages = [-(-s // page_size) for s in seq_lens]
    if any(p > max_pages for p in pages):
        raise ValueError(f"a request needs more than max_pages * page_size = {max_pages * page_size} positions")
    kv_indptr = torch.zeros(n + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(pages, dtype=torch.int32), 0)
    # flat positions of the used entries of page_table, gathered on its device (no host sync)
    flat = torch.cat([torch.arange(p, dtype=torch.int64) + r * max_pages for r, p in enumerate(pages)]) \
        if n else torch.zeros(0, dtype=torch.int64)
    kv_indices = page_table.reshape(-1)[flat.to(page_table.device, non_blocking=True)].to(torch.int32)
    last = torch.tensor([s - (p - 1) * page_size if p else 0 for s, p in zip(seq_lens, pages)],
                        dtype=torch.int32)
    return kv_indptr, kv_indices, last


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
    """FlashInfer version of :func:`common.ops.attention.reference.paged_attention` (same contract).

    Returns [T, H, D] in q.dtype.
    """
    if not supports(q, k_cache) or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype \
            or v_cache.stride(-1) != 1 or q.dim() != 3 or k_cache.dim() != 4:
        return reference.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                                         prefix_lens=prefix_lens, extend_lens=extend_lens, scale=scale)
    t, h, d = q.shape
    _, page_size, kvh, _ = k_cache.shape
    if page_table.dim() != 2 or page_table.is_floating_point():
        raise ValueError(f"page_table must be an integer [N, max_pages] tensor, got {tuple(page_table.shape)}")
    n = page_table.shape[0]
    prefix = reference.as_lengths("prefix_lens", prefix_lens, n)
    extend = reference.as_lengths("extend_lens", extend_lens, n)
    if sum(extend) != t:
        raise ValueError(f"sum(extend_lens) = {sum(extend)} but q has {t} tokens")
    out = torch.empty_like(q)
    # requests without new tokens own no rows of q and need no attention
    rows = [r for r in range(n) if extend[r] > 0]
    if not rows:
        return out
    table = page_table if len(rows) == n else page_table[torch.tensor(rows, device=page_table.device)]
    seq_lens = [prefix[r] + extend[r] for r in rows]
    kv_indptr, kv_indices, last = page_indices(table.to(q.device, non_blocking=True), seq_lens, page_size)
    q = q if q.is_contiguous() else q.contiguous()
    if all(extend[r] == 1 for r in rows):
        wrapper = _wrapper("decode", q.device, decode_uses_tensor_cores(h, kvh))
        wrapper.plan(kv_indptr, kv_indices, last, h, kvh, d, page_size, q_data_type=q.dtype,
                     kv_data_type=k_cache.dtype, sm_scale=scale)
        wrapper.run(q, (k_cache, v_cache), out=out)
        return out
    qo_indptr = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor([extend[r] for r in rows], dtype=torch.int32), 0)
    wrapper = _wrapper("prefill", q.device)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, h, kvh, d, page_size, causal=True,
                 sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
    wrapper.run(q, (k_cache, v_cache), out=out)
    return out
