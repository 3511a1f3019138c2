"""Log-probabilities of generated tokens, and of the most likely tokens at their positions.

What is reported is the model's raw distribution at each position: ``log_softmax`` of the
logits, before temperature, top-k, top-p and min-p (vLLM's default ``raw_logprobs``). So the
numbers do not depend on how the token was picked: a greedy and a sampled request on the same
prefix report the same distribution, and a token committed by a DFLASH step reports the target
model's distribution at its position in the verified block, which is what a plain decode step
at that position computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MAX_LOGPROBS", "TokenLogprobs", "StepLogprobs", "check_num_logprobs",
           "check_asked", "logprobs_per_row"]

# Alternatives per position a request may ask for: OpenAI's limit on ``top_logprobs``.
MAX_LOGPROBS = 20


def check_num_logprobs(value: object) -> None:
    """Raise ValueError unless ``value`` is None or an int in [0, MAX_LOGPROBS]."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got "
                         f"{value!r}")


@dataclass(frozen=True)
class TokenLogprobs:
    """At one output position: ``logprob`` of the token generated there, and ``top``, the
    ``(token id, logprob)`` of the most likely tokens, most likely first (as many as the
    request asked for; the generated token is among them only if it is that likely)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_asked(logprobs: TokenLogprobs | None, num_top: int | None) -> None:
    """Raise ValueError unless ``logprobs`` (of a token made elsewhere: a handoff's first
    token) are there exactly when the request asks for them (``num_top`` not None), with as
    many alternatives as it asks for."""
    if num_top is None and logprobs is not None:
        raise ValueError("log-probabilities the request did not ask for")
    if num_top is not None and (logprobs is None or len(logprobs.top) != num_top):
        have = "none" if logprobs is None else f"{len(logprobs.top)} alternatives"
        raise ValueError(f"the request asks for log-probabilities with {num_top} alternatives; "
                         f"got {have}")


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
