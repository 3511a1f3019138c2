"""Which drafted tokens a speculative step keeps, so that the output distribution is exactly the
target's (lossless), for greedy and for sampled requests.

The draft proposes greedily (a point mass on one token per position), as in SGLang's DFLASH
worker. For a point-mass draft q = δ(x), chain rejection sampling reduces to: accept draft x_i
with probability p_i(x_i); at the first rejection draw the correction from the residual
max(p_i − q_i, 0) ∝ p_i with x_i removed; if every draft is accepted draw the bonus from the last
position's p. p_i is the request's own filtered distribution (temperature, top-k, top-p, min-p:
``common.engine.sampler.filtered_probs``), so speculation changes nothing a sampler would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine.cuda_graph import recorded_event
from common.engine.sampler import exponential_noise, filtered_probs
from common.sampling import SamplingParams


@dataclass(frozen=True)
class Acceptance:
    """Per request: ``num_accepted`` drafts kept (0..B-1) and the ``bonus`` token after them;
    the step commits ``num_accepted + 1`` tokens: the drafts, then the bonus."""

    num_accepted: int
    bonus: int

    @property
    def commit_len(self) -> int:
        return self.num_accepted + 1


def greedy_match(drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[2, N] on the logits' device, nothing read on the host: row 0 the length of the longest
    prefix of ``drafts`` [N, B-1] equal to the target's argmax over ``logits`` [N, B, V], row 1
    the target's argmax right after it (the bonus)."""
    choice = logits.argmax(-1)  # [N, B]
    match = (drafts.to(choice.dtype) == choice[:, :-1]).int().cumprod(-1).sum(-1)  # [N]
    bonus = choice.gather(1, match[:, None]).squeeze(1)
    return torch.stack([match.to(bonus.dtype), bonus])


def read_greedy(matched: torch.Tensor) -> list[Acceptance]:
    """The :class:`Acceptance` of each request from :func:`greedy_match` (one host read)."""
    matches, bonuses = matched.tolist()
    return [Acceptance(int(m), int(b)) for m, b in zip(matches, bonuses)]


class GreedyReader:
    """Reads :func:`greedy_match` outcomes through one pinned host buffer, the copy queued
    when :meth:`start` is called: the host then waits for the work queued before it, not for
    work launched between the start and the read (the next step's draft, launched ahead).
    A ``.tolist()`` waits for everything on the stream."""

    def __init__(self, device: torch.device | str, rows: int) -> None:
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None
        self._rows = rows

    def start(self, matched: torch.Tensor):
        """Queue the copy of ``matched`` ([2, n], n <= rows); returns the read, a callable
        giving :func:`read_greedy`'s list. One read in flight at a time."""
        if self.device.type != "cuda":
            values = matched.clone()
            return lambda: read_greedy(values)
        n = matched.shape[1]
        if self._host is None or self._host.numel() < 2 * n or self._host.dtype != matched.dtype:
            self._host = torch.empty(2 * max(n, self._rows), dtype=matched.dtype,
                                     pin_memory=True)
        # a contiguous view: a copy into a strided host tensor goes through a staging
        # tensor and waits for the stream, whatever non_blocking says
        host = self._host[:2 * n].view(2, n)
        host.copy_(matched.contiguous(), non_blocking=True)
        copied = recorded_event(self.device)

        def read() -> list[Acceptance]:
            copied.synchronize()
            return read_greedy(host)
        return read


def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> list[Acceptance]:
    """Longest prefix of ``drafts`` [N, B-1] equal to the target's argmax over ``logits``
    [N, B, V]; the bonus is the target's argmax right after it."""
    return read_greedy(greedy_match(drafts, logits))


# rows of a batch taken together by accept_sampled_rows: at most this many elements in each
# [rows, B, V] temporary (64 MiB in fp32), so a large vocabulary costs memory by chunks
CHUNK_ELEMENTS = 1 << 24


def accept_sampled_rows(drafts: torch.Tensor, logits: torch.Tensor,
                        params: Sequence[SamplingParams],
                        generators: Sequence[torch.Generator | None]) -> list[Acceptance]:
    """Lossless rejection sampling of N requests' point-mass drafts [N, B-1] against their
    target logits [N, B, V], on the logits' device with one host read for the whole batch.

    Each row draws every draft's uniform at once from its own generator (those after the
    first rejection go unused, which changes nothing: each is independent of the rest), then
    one draw, by the exponential race of ``common.engine.sampler``, from the distribution the
    rule gives after the accepted prefix: the residual at the first rejection, or the last
    position's p when every draft is kept. Rows are taken ``CHUNK_ELEMENTS`` at a time.
    """
    n, b, vocab = logits.shape
    k = b - 1
    if drafts.shape != (n, k) or len(params) != n or len(generators) != n:
        raise ValueError(f"need drafts [N, B-1] and one SamplingParams and generator per row: "
                         f"drafts {tuple(drafts.shape)}, logits {tuple(logits.shape)}, "
                         f"{len(params)} params, {len(generators)} generators")
    device = logits.device
    drafts = drafts.to(device=device, dtype=torch.int64)
    step = max(1, CHUNK_ELEMENTS // (b * vocab))
    outcomes = []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        outcomes.append(_accept_chunk(drafts[lo:hi], logits[lo:hi], params[lo:hi],
                                      generators[lo:hi]))
    accepted, bonus = torch.cat(outcomes, dim=1).tolist()
    return [Acceptance(int(a), int(t)) for a, t in zip(accepted, bonus)]


def _accept_chunk(drafts: torch.Tensor, logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """``[2, n]``: accepted drafts and the bonus token of each row (see accept_sampled_rows)."""
    n, b, vocab = logits.shape
    k = b - 1
    probs = filtered_probs(logits.reshape(n * b, vocab),
                           [p for p in params for _ in range(b)]).view(n, b, vocab)
    u = torch.stack([torch.rand(k, generator=g, device=logits.device) for g in generators])
    index = drafts.view(n, k, 1)
    p_draft = probs[:, :k].gather(2, index).squeeze(2)  # [n, k]
    # a rejection where p puts all its mass on the draft (u fell on p's rounding error below
    # 1) keeps the draft: it is the only draw the distribution allows
    others = (probs[:, :k] > 0).sum(-1) - (p_draft > 0).int()  # tokens besides the draft
    keep = (u < p_draft) | (others == 0)
    accepted = keep.int().cumprod(1).sum(1)  # each row's first rejection, or k
    # what follows: at a rejection the residual max(p - q, 0), that is p without the rejected
    # draft; after every draft the last position's p. The race below needs no normalising.
    rows = torch.arange(n, device=logits.device)
    chosen = probs[rows, accepted]  # [n, V]
    rejected = drafts[rows, accepted.clamp(max=k - 1)].view(n, 1)
    kept = chosen.gather(1, rejected).masked_fill((accepted < k).view(n, 1), 0.0)
    chosen.scatter_(1, rejected, kept)
    bonus = chosen.div_(exponential_noise(chosen, generators)).argmax(-1)
    return torch.stack([accepted.to(torch.int64), bonus])


def accept_sampled(drafts_row: torch.Tensor, logits_row: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None) -> Acceptance:
    """:func:`accept_sampled_rows` for one request: drafts [B-1], logits [B, V]."""
    return accept_sampled_rows(drafts_row.view(1, -1), logits_row.unsqueeze(0), [params],
                               [generator])[0]
