"""The batched token sampler: one token id per row of logits, by each row's SamplingParams.

Non-greedy rows draw from `filtered_probs`, the same function speculative decoding uses for its
rejection test, so the distribution that is sampled and the distribution that is verified cannot
drift apart.

Filtering order is temperature -> top-k -> top-p -> min-p, each step applied to what the previous
step kept. Semantics follow vLLM: top-k and top-p are off at their defaults, top-p keeps the
smallest set of most likely tokens whose cumulative probability reaches top_p (the top token is
always kept), and min-p drops tokens whose probability is below min_p times the largest probability.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.sampling import SamplingParams

__all__ = ["Sampler", "exponential_noise", "filtered_probs", "make_generator"]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on `device` seeded with `seed`; None (the default RNG) when seed is None."""
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


def _on_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """A small per-row vector on ``device`` without a host wait. ``torch.tensor(values,
    device=cuda)`` copies from pageable memory and then waits for the stream, that is for every
    kernel queued before it: under overlap scheduling, the forward just launched. Staged in
    pinned memory, the copy is queued like a kernel instead."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _filtered_probs_2d(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Row-wise final distributions [N, V] (fp32) for 2-D logits; see `filtered_probs`."""
    n, vocab = logits.shape
    device = logits.device
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    # the whole [N, V] output and the rows' index exist only for a batch of both kinds
    probs = row_idx = None
    if greedy_rows:
        probs = torch.empty((n, vocab), dtype=torch.float32, device=device)
        # The greedy "distribution" is a point mass on the argmax, which makes rejection sampling
        # against a greedy target reduce to exact-match verification.
        idx = _on_device(greedy_rows, torch.int64, device)
        onehot = torch.zeros((len(greedy_rows), vocab), dtype=torch.float32, device=device)
        onehot.scatter_(1, logits[idx].argmax(dim=-1, keepdim=True), 1.0)
        probs[idx] = onehot
        if not rows:
            return probs
        row_idx = _on_device(rows, torch.int64, device)
    sel = [params[i] for i in rows]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in sel]
    top_ps = [p.top_p for p in sel]
    min_ps = [q.min_p for q in sel]
    # every row's settings in one copy: temperature, top-k (exact in fp32 for any vocabulary
    # below 2^24), top-p, min-p
    settings = _on_device([[p.temperature for p in sel], top_ks, top_ps, min_ps], torch.float32,
                          device)
    x = (logits if row_idx is None else logits[row_idx]).float() / settings[0].unsqueeze(1)

    # top-k and top-p act on ranks, so they share one sort. Skipping them when no row asks keeps
    # the common (default) case free of a full-vocabulary sort.
    if any(k < vocab for k in top_ks) or any(tp < 1.0 for tp in top_ps):
        # A stable descending sort puts the lowest index first among ties, so top_k=1 picks the
        # same token as argmax.
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        k = settings[1].long().unsqueeze(1)
        sorted_x = sorted_x.masked_fill(ranks >= k, float("-inf"))
        tp = settings[2].unsqueeze(1)
        need_p = tp < 1.0
        if any(t < 1.0 for t in top_ps):
            sorted_probs = torch.softmax(sorted_x, dim=-1)
            # Probability mass strictly before each rank: a token is kept while the tokens ranked
            # above it have not yet reached top_p, which keeps the smallest set reaching top_p
            # and always the top token. Rows with top_p == 1 are exempt because rounding can push
            # the running sum to 1 before the tail and would drop tokens that should stay.
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop = (mass_before >= tp) & need_p
            drop[:, 0] = False
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter_(1, order, sorted_x)

    p = torch.softmax(x, dim=-1)
    if any(m > 0.0 for m in min_ps):
        # The threshold is relative to the top probability, so it is unchanged by renormalising
        # after top-k/top-p; the top token always survives (p_max >= min_p * p_max).
        mp = settings[3].unsqueeze(1)
        p_max = p.max(dim=-1, keepdim=True).values
        p = p.masked_fill(p < mp * p_max, 0.0)
        p = p / p.sum(dim=-1, keepdim=True)
    if row_idx is None:
        return p
    probs[row_idx] = p
    return probs


def filtered_probs(
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
) -> torch.Tensor:
    """The exact fp32 distribution the sampler draws from.

    logits: [V] with one SamplingParams, or [N, V] with one SamplingParams per row (a single
        SamplingParams is applied to every row).
    Returns probabilities of the same shape, summing to 1 per row, with filtered tokens exactly 0.
    Greedy rows give a one-hot on the argmax (lowest index among ties).
    """
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must be [V] or [N, V], got shape {tuple(logits.shape)}")
    squeeze = logits.dim() == 1
    rows = logits.unsqueeze(0) if squeeze else logits
    if isinstance(params, SamplingParams):
        params = [params] * rows.shape[0]
    elif len(params) != rows.shape[0]:
        raise ValueError(f"got {len(params)} SamplingParams for {rows.shape[0]} logits rows")
    out = _filtered_probs_2d(rows, params)
    return out.squeeze(0) if squeeze else out


class Sampler:
    """Picks one token per row of logits according to each row's SamplingParams."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Sample token ids.

        logits: [N, V] float. params, generators: one per row; a row's generator (from
            `make_generator`) is its only source of randomness, so a seeded request draws the same
            tokens whatever else shares the batch. None uses the default RNG.
        Returns a LongTensor [N] on the logits' device.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(
                f"need one SamplingParams and one generator per row: {n} rows, "
                f"{len(params)} params, {len(generators)} generators"
            )
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        if len(greedy) == n:
            # the common case takes no index tensors: no host-to-device copy in the step
            return logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        # small index tensors go through _on_device: no host wait for the forward before them
        row_idx = _on_device(rows, torch.int64, logits.device) if greedy else None
        probs = filtered_probs(logits if row_idx is None else logits[row_idx],
                               [params[i] for i in rows])
        drawn = probs.div_(exponential_noise(probs, [generators[i] for i in rows])).argmax(-1)
        if row_idx is None:
            return drawn
        out = logits.argmax(dim=-1)
        out[row_idx] = drawn
        return out


def exponential_noise(probs: torch.Tensor,
                       generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs`` [N, V]: row j from ``generators[j]``'s stream (the
    default RNG where None, for all such rows in one draw).

    ``argmax(probs / noise)`` is then an exact draw from each row's distribution (the
    exponential race: the first of independent clocks of rates p_v to ring), which vLLM's
    sampler uses too. A seeded row costs one fill of its noise row, where a draw of its own
    through ``torch.multinomial`` costs several kernels and a write of the result (128 seeded
    rows: a tenth of the host time on the H200, ``benchmarks/sampler_host.py``). Noise of
    exactly 0 (possible, at float resolution) is raised to the smallest normal float, so a
    token of probability 0 is never chosen.
    """
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()  # seeded rows are overwritten below: no index tensor needed
    for j, gen in enumerate(generators):
        if gen is not None:
            noise[j].exponential_(generator=gen)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
