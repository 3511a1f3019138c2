"""The fixed input buffers a captured forward reads, and how a step fills them.

Per row: ``q_len`` token ids, positions and flat KV slots, and one GDN state slot, in one packed
int64 device buffer, so a step's inputs are a single host-to-device copy. Filling it is host
time on the critical path of every graphed step (a DFLASH step is not overlapped with the one
before it), so the rows are computed as arrays, not token by token: a verify step of 64 rows of
16 tokens took 0.43 ms of host time filled in a Python loop on the CPU machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.model.forward_batch import ForwardBatch, ForwardMode

__all__ = ["StaticInputs"]


class StaticInputs:
    """The fixed device buffers a graph reads: per row, ``q_len`` token ids, positions and
    flat KV slots, and one GDN state slot. Row r's tokens are entries r*q_len .. r*q_len+q_len-1.
    One packed int64 buffer, so a step's inputs are a single host-to-device copy."""

    def __init__(self, max_rows: int, q_len: int, device: torch.device) -> None:
        self.max_rows, self.q_len = max_rows, q_len
        t = max_rows * q_len
        self.packed = torch.zeros(3 * t + max_rows, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_cache_loc, self.state_slots = torch.split(
            self.packed, [t, t, t, max_rows])
        self.cu_seqlens = torch.arange(max_rows + 1, dtype=torch.int64, device=device) * q_len
        self.logits_positions = torch.arange(t, dtype=torch.int64, device=device)
        # two staging buffers, used in turn: a step may be filled while the copy of the one
        # before it has not run yet (overlap scheduling)
        self._hosts = [torch.zeros_like(self.packed, device="cpu") for _ in range(2)]
        if device.type == "cuda":
            self._hosts = [h.pin_memory() for h in self._hosts]
        self._turn = 0

    def fill(self, token_ids: Sequence[Sequence[int]] | None, starts: Sequence[int],
             page_ids: Sequence[Sequence[int]], slots: Sequence[int], page_size: int) -> None:
        """Rows given are the real requests; the rest become padding (all zeros: token 0 at
        position 0 in scratch KV slot 0 and scratch state slot 0). ``token_ids`` None leaves
        the ids zero, for the caller to write on the device."""
        t, q, n = self.max_rows * self.q_len, self.q_len, len(starts)
        host = self._hosts[self._turn]
        self._turn ^= 1
        host.zero_()
        if n:
            out = host.numpy()
            start = np.asarray(starts, dtype=np.int64)
            pos = start[:, None] + np.arange(q, dtype=np.int64)  # [n, q]
            block, offset = np.divmod(pos, page_size)
            # the pages a row's new tokens fall in: the page of its first one and the few after
            first = block[:, 0]
            width = (q + page_size - 2) // page_size + 1
            held = np.fromiter(map(len, page_ids), dtype=np.int64, count=n)
            short = np.flatnonzero(held <= block[:, -1])
            if short.size:
                r = int(short[0])
                raise ValueError(f"row {r}: {held[r]} pages hold no page for position "
                                 f"{starts[r] + q - 1} ({page_size} tokens a page)")
            if width == 1:  # decode: one token, one page
                page = np.array([pages[f] for pages, f in zip(page_ids, first.tolist())],
                                dtype=np.int64)[:, None]
            else:
                spans = [pages[f:f + width] for pages, f in zip(page_ids, first.tolist())]
                spans = [span if len(span) == width else list(span) + [0] * (width - len(span))
                         for span in spans]
                table = np.array(spans, dtype=np.int64).reshape(n, width)
                page = table[np.arange(n)[:, None], block - first[:, None]]
            if token_ids is not None:
                out[:n * q] = np.asarray(token_ids, dtype=np.int64).reshape(-1)
            out[t:t + n * q] = pos.reshape(-1)
            out[2 * t:2 * t + n * q] = (page * page_size + offset).reshape(-1)
            out[3 * t:3 * t + n] = np.asarray(slots, dtype=np.int64)
        self.packed.copy_(host, non_blocking=True)

    def advance(self, n: int, lengths: torch.Tensor, first_ids: torch.Tensor,
                rest_ids: torch.Tensor | None, table: torch.Tensor, page_size: int) -> None:
        """Move the first ``n`` rows on the device, nothing read on the host: row r's tokens
        start ``lengths[r]`` positions later than the rows hold now, its ids become
        ``first_ids[r]`` then ``rest_ids[r]`` (``[n, q_len - 1]``), and its KV slots come from
        ``table[r]``, its page ids from its first page on (``[>= n, pages]``)."""
        q = self.q_len
        ids = self.input_ids[:n * q].view(n, q)
        ids[:, 0].copy_(first_ids[:n])
        if q > 1:
            ids[:, 1:].copy_(rest_ids[:n])
        pos = self.positions[:n * q].view(n, q)
        pos.add_(lengths[:n, None].to(pos.dtype))
        pages = table[:n].to(torch.int64).gather(1, pos // page_size)
        self.out_cache_loc[:n * q].view(n, q).copy_(pages * page_size + pos % page_size)

    def batch(self, mode: ForwardMode, rows: int, attention) -> ForwardBatch:
        """The ForwardBatch of the first ``rows`` rows (views of the buffers). Its host lists
        describe the shape only: a graph forward reads lengths from ``cu_seqlens`` and the
        attention plan, never from the lists."""
        t = rows * self.q_len
        return ForwardBatch(
            mode=mode, input_ids=self.input_ids[:t], positions=self.positions[:t],
            prefix_lens=[0] * rows, extend_lens=[self.q_len] * rows,
            page_table=torch.zeros(rows, 1, dtype=torch.int32, device=self.packed.device),
            out_cache_loc=self.out_cache_loc[:t], state_slots=self.state_slots[:rows],
            logits_positions=self.logits_positions[:t], cu_seqlens=self.cu_seqlens[:rows + 1],
            attention=attention)
