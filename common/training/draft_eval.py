"""A draft's held-out evaluation during ``flashsplit train-draft``: the training loss, the mean
accept length over uniform anchors (what training reports on its own batches), and the τ a
decode would see.

The last two differ a lot. A decode's blocks start where the previous step ended, just after a
rejection, so the hard places of a text get many short steps and the easy ones few long ones:
τ is tokens over steps, nearer a harmonic than an arithmetic mean of the accept lengths. On the
2026-12-06 medium built-in pair (docs/training.md) the uniform mean was 6.49 where the walk
below gave 3.13 and decoding measured 2.84–3.26, so only the walk predicts τ.

The walk: for every anchor ``a`` of a window, ``L(a) = 1 +`` the draft's leading correct rows of
the block ``[token a, MASK x (B-1)]`` (rows on label tokens only: a decode ends where the target's
text ends); along each run of label tokens, from its first token, steps go ``a -> a + L(a)``.
With the target's greedy continuations as data, that is the greedy τ the draft would get
(teacher-forced, in the training forward's precision).

Held-out data: a separate file (``eval_data``), else every k-th document of the training data
(``eval_fraction`` ~ 1/k), which then never enters training; data of fewer than k documents
(a single text file) has none to spare and is trained on whole, without evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.training.draft_forward import accept_runs, block_hidden, block_logits, row_weights
from common.training.token_data import Document, spaced_starts

__all__ = ["DraftEval", "split_held_out", "decode_walk", "HeldOutSet"]

# logits an evaluation holds at once (windows x anchors x (B-1) x vocab fp32 values): 256 MB,
# which sets how many anchors go through the draft together
LOGITS_BUDGET = 1 << 26


@dataclass(frozen=True)
class DraftEval:
    """One evaluation: the weighted block loss, the uniform-anchor accept length and the
    decode walk's τ, over the held-out windows."""

    step: int
    loss: float
    accept_length: float
    tau: float

    def row(self) -> dict:
        return {"step": self.step, "loss": round(self.loss, 4),
                "accept_length": round(self.accept_length, 4), "tau": round(self.tau, 4)}


def split_held_out(documents: list[Document], fraction: float
                   ) -> tuple[list[Document], list[Document]]:
    """(training, held-out): every k-th document held out, k = round(1 / fraction), the
    first at index k - 1. Fraction 0, or data of fewer than k documents, holds none out."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"eval_fraction must lie in [0, 1), got {fraction}")
    k = max(2, round(1.0 / fraction)) if fraction else 0
    if not k or len(documents) < k:
        return list(documents), []
    held = [d for i, d in enumerate(documents) if i % k == k - 1]
    kept = [d for i, d in enumerate(documents) if i % k != k - 1]
    return kept, held


def decode_walk(lengths: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(steps, tokens) of decoding one window: ``lengths[a - 1]`` is L(a) for the anchors
    ``a = 1 .. len(lengths)`` (those with a whole block in the window), ``labels`` the
    window's [T] bool label tokens. Each maximal run of label tokens is decoded from its first
    token (the one a prefill samples; a run already under way at the window's start, from
    token 1) to its last: a step at anchor ``a`` yields the tokens ``a+1 .. a+L(a)`` that
    are still in the run."""
    lengths, labels = lengths.tolist(), labels.tolist()
    last, end = len(lengths), len(labels) - 1
    steps = tokens = 0
    a = 1
    while a <= last:
        if not labels[a] or (a > 1 and labels[a - 1]):
            a += 1  # not the start of a run
            continue
        e = a
        while e < end and labels[e + 1]:
            e += 1
        while a < e and a <= last:
            steps, tokens = steps + 1, tokens + min(lengths[a - 1], e - a)
            a += lengths[a - 1]
        a = e + 1
    return steps, tokens


class HeldOutSet:
    """Fixed held-out windows ([m, T] tokens and labels) and their evaluation."""

    def __init__(self, stream: torch.Tensor, labels: torch.Tensor, seq_len: int,
                 count: int) -> None:
        starts = spaced_starts(stream.numel(), seq_len, count)
        at = starts[:, None] + torch.arange(seq_len)
        self.tokens, self.labels = stream[at].long(), labels[at]
        self.num_tokens = int(stream.numel())

    def evaluate(self, step: int, *, draft, capture, embed: torch.Tensor,
                 lm_head: torch.Tensor, loss_decay_gamma: float | None, batch_size: int,
                 autocast: bool) -> DraftEval:
        """Every anchor of every window through the training forward, without gradients."""
        b = draft.config.block_size
        t = self.tokens.shape[1]
        rows = torch.arange(1, b)
        weights = row_weights(b, loss_decay_gamma)
        loss_sum = weight_sum = accept_sum = blocks = 0.0
        steps = tokens = 0
        device = next(draft.parameters()).device
        was_training = draft.training
        draft.eval()
        try:
            with torch.no_grad():
                for i in range(0, len(self.tokens), batch_size):
                    windows = self.tokens[i:i + batch_size]
                    labels = self.labels[i:i + batch_size]
                    aux = capture(windows)
                    toks = windows.to(device)
                    lengths = torch.zeros(len(windows), t - b, dtype=torch.long)
                    chunk = max(1, LOGITS_BUDGET // (len(windows) * (b - 1) * lm_head.shape[0]))
                    for c0 in range(1, t - b + 1, chunk):
                        anchors = torch.arange(c0, min(c0 + chunk, t - b + 1))
                        at = anchors[:, None] + rows  # [A, B-1]
                        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                            hidden = block_hidden(draft, aux, toks,
                                                  anchors.expand(len(windows), -1).to(device),
                                                  embed)[:, :, 1:]
                            logits = block_logits(draft, hidden, lm_head)  # [S, A, B-1, V]
                        targets = toks[:, at.to(device)]
                        counted = labels[:, at]  # [S, A, B-1] (CPU)
                        ce = F.cross_entropy(logits.flatten(0, 2), targets.flatten(),
                                             reduction="none").view(counted.shape).cpu()
                        w = weights * counted
                        loss_sum += float((ce * w).sum())
                        weight_sum += float(w.sum())
                        correct = (logits.argmax(-1) == targets).cpu() & counted
                        run = accept_runs(correct)
                        lengths[:, anchors - 1] = run
                        first = counted[:, :, 0]  # blocks whose first row is a label
                        accept_sum += float((run * first).sum())
                        blocks += float(first.sum())
                    for s in range(len(windows)):
                        n, k = decode_walk(lengths[s], labels[s])
                        steps, tokens = steps + n, tokens + k
        finally:
            draft.train(was_training)
        return DraftEval(step=step, loss=loss_sum / max(weight_sum, 1e-6),
                         accept_length=accept_sum / max(blocks, 1.0),
                         tau=tokens / steps if steps else float("nan"))
