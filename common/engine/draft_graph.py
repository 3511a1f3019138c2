"""CUDA-graph replay of the DFLASH draft's proposal forward, greedy argmax included.

A step of n requests runs the graph of the smallest captured batch size >= n. The graph reads
fixed device buffers: the blocks ``[last committed token, MASK x (B-1)]``, each block's start
position (= its context length) and the page table. Padding rows have start 0, so they attend to
their own block only and read no page; the draft writes nothing to any pool while proposing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.cache.kv_pool import page_table
from common.engine.cuda_graph import capture_graphs
from common.engine.request import Request
from common.model.dflash import DFlashDraftModel, DraftKVPool
from common.model.qwen3_5 import HybridForCausalLM
from common.ops.attention.planned import PinnedStaging


class DraftGraphRunner:
    """Greedy proposals ``[n, B-1]`` of the draft for n requests, from one graph per batch size.

    Args:
        capture: False runs the same buffers and padding eagerly (CPU tests).
        vocab: the full input embedding and output weight the draft reads, where the target
            holds only its rows of them (tensor parallelism); None: the target's own.
    """

    def __init__(self, draft: DFlashDraftModel, target: HybridForCausalLM, pool: DraftKVPool, *,
                 batch_sizes: Sequence[int], block_size: int, mask_token_id: int,
                 capture: bool = True,
                 vocab: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.draft, self.target, self.pool = draft, target, pool
        self.embed, self.lm_head = vocab if vocab is not None else (
            target.get_input_embeddings().weight, target.get_output_weight())
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.capture_graphs = capture
        device = pool.kv.device
        rows = self.batch_sizes[-1]
        self.blocks = torch.full((rows, block_size), mask_token_id, dtype=torch.int64,
                                 device=device)
        self.starts = torch.zeros(rows, dtype=torch.int64, device=device)
        # a row can hold every page of the pool: rows never need to grow
        self.page_table = torch.zeros(rows, pool.num_pages, dtype=torch.int32, device=device)
        # pinned on a GPU: a copy from pageable memory may wait for the stream, which holds
        # the step before when this one is launched ahead of its read
        self._pages = PinnedStaging(device, rows * 64, limit=self.page_table.numel())
        self._host = torch.zeros(2, rows, dtype=torch.int64)  # last tokens, starts
        if device.type == "cuda":
            self._host = self._host.pin_memory()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.captured = not capture

    def serves(self, num_requests: int) -> bool:
        return self.captured and 0 < num_requests <= self.batch_sizes[-1]

    def padded_size(self, num_requests: int) -> int:
        return next(bs for bs in self.batch_sizes if bs >= num_requests)

    def _forward(self, bs: int) -> torch.Tensor:
        logits = self.draft.propose(
            block_ids=self.blocks[:bs], start_positions=self.starts[:bs],
            page_table=self.page_table[:bs], pool=self.pool,
            embed=self.embed, lm_head=self.lm_head)
        return logits.argmax(-1)

    def _fill(self, last_tokens: Sequence[int], starts: Sequence[int],
              pages: Sequence[Sequence[int]]) -> None:
        n = len(last_tokens)
        self._host.zero_()
        if n:
            self._host[0, :n] = torch.tensor(list(last_tokens), dtype=torch.int64)
            self._host[1, :n] = torch.tensor(list(starts), dtype=torch.int64)
            self._write_pages(pages)
        # padding rows (start 0) read no page, so their table rows may hold anything
        self.blocks[:, 0].copy_(self._host[0], non_blocking=True)
        self.starts.copy_(self._host[1], non_blocking=True)

    def _write_pages(self, pages: Sequence[Sequence[int]]) -> None:
        table = page_table(pages)
        staged = self._pages.take(table.numel()).view(table.shape)
        staged.copy_(table)
        self.page_table[:len(pages), :table.shape[1]].copy_(staged, non_blocking=True)
        self._pages.queued()

    def capture(self, progress: bool = True) -> None:
        if self.captured:
            return
        self.graphs, self.outputs = capture_graphs(
            self.batch_sizes, prepare=lambda bs: self._fill([], [], []), forward=self._forward,
            label="draft graphs", progress=progress)
        self.captured = True

    def run_next(self, bonus: torch.Tensor, lengths: torch.Tensor,
                 pages: Sequence[Sequence[int]]) -> torch.Tensor:
        """Launch the proposal of the step after the one whose blocks this runner last
        proposed (:meth:`run` or :meth:`run_next`), for the same rows, before the host has read
        that step: each row's block starts where the step's commit left it (its start plus the
        committed ``lengths[r]``, on the device) with the step's ``bonus[r]`` token, over
        ``pages[r]``, the pages of the step's verified block (they cover the new context).
        Returns the proposals ``[n, B-1]`` as :meth:`run` does; valid while no other run of
        the same batch size follows."""
        n = len(pages)
        self._write_pages(pages)
        self.blocks[:n, 0].copy_(bonus[:n])
        self.starts[:n].add_(lengths[:n])  # padding rows keep start 0: they read no page
        return self._propose(n)

    def run(self, requests: Sequence[Request], pages: Sequence[Sequence[int]]) -> torch.Tensor:
        """Proposals ``[n, B-1]`` (int64, on the device; a view valid until the next run) for
        blocks starting at each request's ``num_cached``, over its context pages ``pages[r]``
        (``outputs[bs]`` holds every row's, padding included)."""
        self._fill([r.output_ids[-1] for r in requests], [r.num_cached for r in requests], pages)
        return self._propose(len(requests))

    def _propose(self, n: int) -> torch.Tensor:
        """The proposals of the first ``n`` rows of the filled buffers."""
        bs = self.padded_size(n)
        if self.capture_graphs:
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:
            out = self.outputs[bs] = self._forward(bs)  # kept as a replay's would be
        return out[:n]
