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

from dataclasses import dataclass

import torch

from common.engine.sampler import filtered_probs
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


def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> list[Acceptance]:
    """Longest prefix of ``drafts`` [N, B-1] equal to the target's argmax over ``logits``
    [N, B, V]; the bonus is the target's argmax right after it."""
    return read_greedy(greedy_match(drafts, logits))


def accept_sampled(drafts_row: torch.Tensor, logits_row: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None) -> Acceptance:
    """Lossless rejection sampling of one request's point-mass drafts [B-1] against its target
    logits [B, V], on the logits' device with one host read.

    Every draft's uniform is drawn at once (those after the first rejection go unused, which
    changes nothing: each is independent of the rest), then one draw from the distribution the
    rule gives after the accepted prefix: the residual at the first rejection, or the last
    position's p when every draft is kept.
    """
    probs = filtered_probs(logits_row, params)  # [B, V], rows sum to 1
    k = drafts_row.numel()
    drafts = drafts_row.to(device=probs.device, dtype=torch.int64).view(k, 1)
    u = torch.rand(k, generator=generator, device=probs.device)
    residual = probs[:k].scatter(1, drafts, 0.0)
    total = residual.sum(-1)
    # a rejection where p puts all its mass on the draft (u fell on p's rounding error below
    # 1) keeps the draft: it is the only draw the distribution allows
    keep = (u < probs[:k].gather(1, drafts).squeeze(1)) | ~(total > 0)
    accepted = keep.int().cumprod(0).sum()  # the first rejection's index, or k
    rows = torch.cat([residual / total.clamp_min(torch.finfo(total.dtype).tiny)[:, None],
                      probs[k:k + 1]])
    bonus = torch.multinomial(rows.index_select(0, accepted.view(1)), 1,
                              generator=generator).view(())
    n, token = torch.stack([accepted.to(torch.int64), bonus]).tolist()
    return Acceptance(int(n), int(token))
