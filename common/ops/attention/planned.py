"""Paged attention planned once per forward for batches whose requests all have ``q_len`` new
tokens (decode: 1; speculative verify: the block size), as CUDA-graph runners need it.

A plan is made for a fixed number of rows (the captured batch size); :meth:`plan` is called
before every forward with the real requests' pages and lengths (padding rows included), and every
full-attention layer then calls :meth:`run`. Two implementations:

- :class:`TorchPlannedAttention` calls any ``paged_attention`` kernel with a page table built by
  :meth:`plan`. It cannot be captured (the kernels read lengths on the host); it is what a runner
  uses when graphs are off, so padding and static buffers are exercised on the CPU too.
- ``common.ops.attention.flashinfer_graph.FlashInferGraphAttention`` keeps FlashInfer's
  indices in fixed device buffers, so the run is capturable and the plan is a buffer update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from common.cache.kv_pool import page_table

__all__ = ["PinnedStaging", "TorchPlannedAttention", "fixed_page_layout", "page_layout"]


def page_layout(page_ids: Sequence[Sequence[int]], seq_lens: Sequence[int], page_size: int
                ) -> tuple[list[int], list[int], list[int]]:
    """FlashInfer's ragged page description of rows with ``seq_lens`` tokens each.

    Returns (indptr [N+1], indices [sum pages], last_page_len [N]) as host lists: row r uses
    its first ``ceil(seq_lens[r] / page_size)`` pages.
    """
    indptr, indices, last = [0], [], []
    for pages, length in zip(page_ids, seq_lens):
        used = -(-length // page_size)
        if used > len(pages):
            raise ValueError(f"{length} tokens need {used} pages, the row has {len(pages)}")
        indices.extend(pages[:used])
        indptr.append(len(indices))
        last.append(length - (used - 1) * page_size)
    return indptr, indices, last


def fixed_page_layout(page_ids: Sequence[Sequence[int]], seq_lens: Sequence[int], *,
                      batch_size: int, q_len: int, page_size: int, max_pages: int
                      ) -> tuple[list[int], list[int], list[int]]:
    """:func:`page_layout` of a plan with fixed buffers (a CUDA-graph plan): exactly
    ``batch_size`` rows, each of at least ``q_len`` tokens, at most ``max_pages`` pages in
    all; ValueError otherwise."""
    if len(seq_lens) != batch_size:
        raise ValueError(f"a plan of this attention has {batch_size} rows, got {len(seq_lens)}")
    if any(s < q_len for s in seq_lens):
        raise ValueError(f"every row needs at least q_len = {q_len} tokens")
    layout = page_layout(page_ids, seq_lens, page_size)
    if len(layout[1]) > max_pages:
        raise ValueError(f"{len(layout[1])} pages exceed the plan's {max_pages}")
    return layout


class PinnedStaging:
    """int32 host memory a CUDA-graph plan writes its rows into and copies to the device from
    without waiting (pinned on a CUDA device, so the copies do not synchronise the stream).

    :meth:`take` waits only for the copies out of what it gave last time, and grows the
    buffer to what plans need, up to ``limit`` entries; :meth:`queued` marks those copies.
    """

    def __init__(self, device: torch.device, size: int, limit: int) -> None:
        self._pinned = device.type == "cuda"
        self._limit = limit
        self._buffer = torch.zeros(size, dtype=torch.int32, pin_memory=self._pinned)
        self._copied: torch.cuda.Event | None = None  # after the last plan's copies

    def take(self, size: int) -> torch.Tensor:
        """The first ``size`` entries, free to write (the last plan's copies have read them)."""
        if self._copied is not None:
            self._copied.synchronize()
        if size > self._buffer.numel():
            self._buffer = torch.zeros(min(max(2 * size, 1024), self._limit), dtype=torch.int32,
                                       pin_memory=self._pinned)
        return self._buffer[:size]

    def queued(self) -> None:
        """Call once the plan's copies out of what :meth:`take` gave are queued."""
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()


class TorchPlannedAttention:
    """``paged_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale)``
    over the rows given to :meth:`plan`, each with ``q_len`` new tokens at its end."""

    def __init__(self, paged_attention: Callable, *, q_len: int, scale: float,
                 device: torch.device | str) -> None:
        self.fn, self.q_len, self.scale = paged_attention, q_len, scale
        self.device = torch.device(device)
        self.page_table: torch.Tensor | None = None
        self.seq_lens: list[int] = []

    def plan(self, page_ids: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> None:
        if any(s < self.q_len for s in seq_lens):
            raise ValueError(f"every row needs at least q_len = {self.q_len} tokens")
        self.page_table = page_table(page_ids, self.device)
        self.seq_lens = list(seq_lens)

    def advance(self, n: int, delta: torch.Tensor) -> None:
        """Row r of the first ``n`` is ``delta[r]`` tokens longer than planned (shorter when
        negative; an uncaptured plan on the host, so the deltas are read)."""
        for r, extra in enumerate(delta[:n].tolist()):
            self.seq_lens[r] += int(extra)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.page_table is None:
            raise RuntimeError("run() before plan()")
        return self.fn(q=q, k_cache=k_cache, v_cache=v_cache, page_table=self.page_table,
                       prefix_lens=[s - self.q_len for s in self.seq_lens],
                       extend_lens=[self.q_len] * len(self.seq_lens), scale=self.scale)
