"""A step's log-probabilities computed from its logits (the records are ``common.logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.logprobs import TokenLogprobs, check_num_logprobs

__all__ = ["StepLogprobs", "logprobs_per_row"]


@dataclass(frozen=True)
class StepLogprobs:
    """The log-probabilities of the rows of one step that asked for them, as tensors (on the
    device that computed them, or copied to the host by :meth:`to_host`).

    rows: which rows of the step asked; num_top: how many alternatives each of them asked for.
    chosen ``[m]``, top_values ``[m, K]`` and top_ids ``[m, K]`` for those rows, with K the
    largest of ``num_top``.
    """

    rows: tuple[int, ...]
    num_top: tuple[int, ...]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, tokens: torch.Tensor,
           num_top: Sequence[int | None]) -> StepLogprobs | None:
        """For ``logits`` ``[N, V]`` and the ``tokens`` ``[N]`` chosen from them, the rows whose
        ``num_top`` is not None; None when no row asks. Queues device work only (no sync)."""
        if logits.dim() != 2 or tokens.dim() != 1 or len(num_top) != logits.shape[0] \
                or tokens.shape[0] != logits.shape[0]:
            raise ValueError(f"need logits [N, V], tokens [N] and N counts; got "
                             f"{tuple(logits.shape)}, {tuple(tokens.shape)}, {len(num_top)}")
        rows = tuple(i for i, k in enumerate(num_top) if k is not None)
        if not rows:
            return None
        counts = tuple(num_top[i] for i in rows)
        for k in counts:
            check_num_logprobs(k)
        if len(rows) < logits.shape[0]:
            index = torch.tensor(rows)
            if logits.device.type == "cuda":
                # a copy from pageable memory would wait for the step queued before it (an
                # overlapped launch must not)
                index = index.pin_memory()
            index = index.to(logits.device, non_blocking=True)
            logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, tokens.to(torch.int64).view(-1, 1)).squeeze(1)
        top_values, top_ids = logprobs.topk(max(counts), dim=-1)
        return cls(rows, counts, chosen, top_values, top_ids)

    def to_host(self) -> StepLogprobs:
        """The same values on the host; from a GPU the copies are queued without waiting
        (pinned memory), so read them only after an event recorded after this call."""
        blocking = self.chosen.device.type == "cpu"
        return StepLogprobs(self.rows, self.num_top,
                            *(t.to("cpu", non_blocking=not blocking)
                              for t in (self.chosen, self.top_values, self.top_ids)))

    def per_row(self, num_rows: int) -> list[TokenLogprobs | None]:
        """One entry per row of the step (None for rows that did not ask); reads the values
        (waits for the device when they are still on it)."""
        out: list[TokenLogprobs | None] = [None] * num_rows
        chosen = self.chosen.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        for j, (row, k) in enumerate(zip(self.rows, self.num_top)):
            out[row] = TokenLogprobs(chosen[j], tuple(zip(ids[j][:k], values[j][:k])))
        return out


def logprobs_per_row(logits: torch.Tensor, tokens: torch.Tensor,
                     num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """:meth:`StepLogprobs.of` read at once (a device sync when some row asks): one entry per
    row, None for rows that do not ask."""
    step = StepLogprobs.of(logits, tokens, num_top)
    return step.per_row(len(num_top)) if step is not None else [None] * len(num_top)
