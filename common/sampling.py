"""A request's sampling parameters and when its generation stops.

Plain data, without torch: the router and the clients validate and forward them. The sampler
that applies them to logits is ``common.engine.sampler``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.logprobs import check_num_logprobs

__all__ = [
    "GREEDY_TEMPERATURE",
    "SamplingParams",
    "stop_reason",
]


# Temperatures below this sample as greedy, as in vLLM (``_SAMPLING_EPS``) and SGLang: dividing
# logits by 1e-300 overflows fp32 to inf (and softmax to NaN) long before it means anything else.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a top_k or seed is a caller mistake.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature: 0 means greedy (argmax), and so does anything below ``GREEDY_TEMPERATURE``;
        otherwise logits are divided by it.
    top_p: nucleus size in (0, 1]; 1 is off.
    top_k: keep the k most likely tokens; 0 or -1 is off.
    min_p: drop tokens with probability < min_p * max probability; 0 is off.
    seed: seeds the request's own generator, making its draws reproducible whatever else is in
        the batch; None uses the process-wide RNG.
    max_new_tokens: generation stops with reason "length" after this many tokens.
    stop_token_ids: tokens that end generation (the token itself is still emitted).
    ignore_eos: keep generating past the model's end-of-sequence tokens.
    logprobs: report each generated token's log-probability and those of the ``logprobs``
        most likely tokens at its position (0: the generated token's only), at most
        ``MAX_LOGPROBS``; None reports none (``common/logprobs.py`` says which distribution).
    speculative: decode with the draft (True: a decode worker that has none refuses the request),
        without it (False), or as the worker has it (None). It changes how tokens are found,
        never which distribution they come from, so it sits with the other per-request choices.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    speculative: bool | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 is off), got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        # Accept any iterable from callers (JSON gives lists) but store a tuple so the params stay
        # hashable and immutable.
        stop_ids = tuple(self.stop_token_ids)
        for t in stop_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        check_num_logprobs(self.logprobs)
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be True, False or None, got {self.speculative!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token (temperature 0 or below
        ``GREEDY_TEMPERATURE``)."""
        return self.temperature < GREEDY_TEMPERATURE


def stop_reason(
    token_id: int,
    num_generated: int,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
) -> str | None:
    """Why generation ends after emitting `token_id`, or None to continue.

    `num_generated` counts the tokens generated so far, including `token_id`. A stop token ends
    generation even on the step that also reaches the length limit, so "stop" wins over "length".
    """
    if token_id in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if num_generated >= params.max_new_tokens:
        return "length"
    return None
