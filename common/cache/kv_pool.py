"""Paged KV cache of the full-attention layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.cache.allocator import IndexAllocator


def page_table(page_ids: Sequence[Sequence[int]], device: torch.device | str = "cpu"
               ) -> torch.Tensor:
    """``[N, max pages]`` int32 page ids of N requests; short rows are padded with page 0, the
    scratch page, never a live request's page."""
    width = max(1, max((len(p) for p in page_ids), default=0))
    return torch.tensor([list(p) + [0] * (width - len(p)) for p in page_ids], dtype=torch.int32,
                        device=device)


class KVPool:
    """KV tensors ``[num_layers, num_pages, 2, page_size, kv_heads, head_dim]`` and their pages.

    ``layer_ids`` are the model's full-attention layer ids; pool layer ``j`` holds model layer
    ``layer_ids[j]``. Page 0 is scratch.
    """

    def __init__(self, *, layer_ids: tuple[int, ...], num_pages: int, page_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if page_size < 1:
            raise ValueError("page_size must be positive")
        self.layer_ids = tuple(layer_ids)
        self._index = {lid: j for j, lid in enumerate(self.layer_ids)}
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv = torch.zeros(len(self.layer_ids), num_pages, 2, page_size, num_kv_heads,
                              head_dim, dtype=dtype, device=device)
        self.allocator = IndexAllocator(num_pages, name="kv pages")

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one model layer, each ``[num_pages, page_size, kv_heads, head_dim]``."""
        kv = self.kv[self._index[layer_id]]
        return kv[:, 0], kv[:, 1]

    def layer_kv(self, layer_id: int) -> torch.Tensor:
        """All K/V of one model layer, a ``[num_pages, 2, page_size, kv_heads, head_dim]`` view
        (the ``kv`` that the ``store_paged_kv`` op writes)."""
        return self.kv[self._index[layer_id]]

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ``[T, kv_heads, head_dim]`` at flat slots ``loc`` ``[T]``."""
        kv = self.layer_kv(layer_id)
        page, offset = loc // self.page_size, loc % self.page_size
        kv[page, 0, offset] = k.to(kv.dtype)
        kv[page, 1, offset] = v.to(kv.dtype)
