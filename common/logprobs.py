"""Log-probabilities of generated tokens, and of the most likely tokens at their positions.

What is reported is the model's raw distribution at each position: ``log_softmax`` of the
logits, before temperature, top-k, top-p and min-p (vLLM's default ``raw_logprobs``). So the
numbers do not depend on how the token was picked: a greedy and a sampled request on the same
prefix report the same distribution, and a token committed by a DFLASH step reports the target
model's distribution at its position in the verified block, which is what a plain decode step
at that position computes.

The records here are plain data (the router and clients carry them); computing them from a
step's logits is ``common.engine.step_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_LOGPROBS", "TokenLogprobs", "check_num_logprobs", "check_asked"]

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
