"""Request checks and response assembly, without protobuf.

``server.py`` turns a ``GenerateRequest`` into the plain values below, and each ``Chunk`` the
dispatcher yields into a ``Delta`` (text, ids, and on the last one usage and timings), which it
turns back into a ``GenerateResponse``.

Timings are measured at the router, from the moment the request arrived:
  time_to_first_token_s   arrival -> the first token reached the router
  inter_token_latencies_s one gap per token after the first: the time since the previous batch
                          of tokens arrived for the first token of a batch, 0 for the others
                          (several tokens arrive together when a speculative step accepts drafts)
  total_s                 arrival -> the last token reached the router
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.logprobs import TokenLogprobs
from common.model.registry import load_config
from common.sampling import SamplingParams
from common.tokenizer import IncrementalDetokenizer, Tokenizer
from router.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class ServedModel:
    """What the router knows about the model: from its config, without loading weights."""

    name: str
    model_type: str
    vocab_size: int
    max_context_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str


def load_served_model(name: str, tokenizer: Tokenizer) -> ServedModel:
    """Read the model's config ("tiny" or a checkpoint directory)."""
    config = load_config(name)
    eos = tuple(dict.fromkeys(tuple(tokenizer.eos_token_ids) + tuple(config.eos_token_ids)))
    return ServedModel(name=name, model_type=config.model_type, vocab_size=config.vocab_size,
                       max_context_len=config.max_position_embeddings, eos_token_ids=eos,
                       dtype=config.dtype)


def new_request_id() -> str:
    return "req-" + secrets.token_hex(8)


def with_seed(params: SamplingParams) -> SamplingParams:
    """Draw a seed when the client set none.

    Workers get fully resolved settings, and a retried attempt then samples as the first would
    have.
    """
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=secrets.randbits(63))


def check_prompt(ids: Sequence[int], params: SamplingParams, model: ServedModel) -> None:
    """Raise ValueError when the prompt or stop ids cannot be served by this model."""
    if not ids:
        raise ValueError("the prompt is empty")
    # min and max run in C; the list of offenders is built only for the message
    if min(ids) < 0 or max(ids) >= model.vocab_size:
        bad = [i for i in ids if not 0 <= i < model.vocab_size]
        raise ValueError(f"prompt token ids {bad[:8]} are outside the vocabulary "
                         f"(0..{model.vocab_size - 1})")
    bad = [i for i in params.stop_token_ids if i >= model.vocab_size]
    if bad:
        raise ValueError(f"stop token ids {bad[:8]} are outside the vocabulary "
                         f"(0..{model.vocab_size - 1})")
    if len(ids) + params.max_new_tokens > model.max_context_len:
        raise ValueError(f"prompt ({len(ids)} tokens) plus max_new_tokens "
                         f"({params.max_new_tokens}) exceeds the context length "
                         f"{model.max_context_len}")


@dataclass(frozen=True)
class Timings:
    time_to_first_token_s: float
    inter_token_latencies_s: tuple[float, ...]
    total_s: float
    prefill_queue_s: float = 0.0
    prefill_s: float = 0.0
    handoff_s: float = 0.0


@dataclass(frozen=True)
class Delta:
    """What is new in one response; usage and timings only on the last (finish_reason set);
    ``logprobs`` one per token when the request asks for them."""

    text: str
    token_ids: tuple[int, ...]
    accept_lengths: tuple[int, ...] = ()
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass
class OutputTracker:
    """Accumulates one request's output: text deltas, ids and per-token arrival gaps.

    With ``stop`` strings, text is cut before the first one (``router/stop_strings.py``): the
    token that completed it is the last one kept, and that call's Delta has finish_reason
    "stop", so the caller stops reading the workers.
    """

    tokenizer: Tokenizer
    prompt_ids: Sequence[int]
    arrival: float
    stop: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    last_arrival: float | None = None

    def __post_init__(self) -> None:
        # The prompt's last ids are decoding context (leading spaces), not output.
        self._detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=self.prompt_ids)
        self._stop = StopStringMatcher(self.stop)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, token_ids: Sequence[int], arrival: float, accept_lengths: Sequence[int] = (),
            finish_reason: str | None = None, prefill_times: tuple[float, float, float] | None
            = None, logprobs: Sequence[TokenLogprobs] = ()) -> Delta:
        """Record tokens that arrived together (with their log-probabilities, when the request
        asks for them); the last call passes finish_reason."""
        pieces, kept = [], 0
        for t in token_ids:
            pieces.append(self._stop.push(self._detok.push(t)))
            kept += 1
            if self._stop.matched is not None:
                finish_reason = "stop"
                break
        token_ids = tuple(token_ids[:kept])
        logprobs = tuple(logprobs[:kept])
        text = "".join(pieces)
        for i, _ in enumerate(token_ids):
            if self.last_arrival is None and i == 0:
                self.ttft = arrival - self.arrival
            else:
                self.gaps.append(arrival - self.last_arrival if i == 0 else 0.0)
        if token_ids:
            self.last_arrival = arrival
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.accept_lengths.extend(accept_lengths)
        timings = None
        if finish_reason is not None:
            text += self._stop.push(self._detok.flush())
            text += self._stop.flush()
            if self._stop.matched is not None:
                finish_reason = "stop"
            queue_s, prefill_s, handoff_s = prefill_times or (0.0, 0.0, 0.0)
            end = self.last_arrival if self.last_arrival is not None else arrival
            timings = Timings(time_to_first_token_s=self.ttft or 0.0,
                              inter_token_latencies_s=tuple(self.gaps),
                              total_s=end - self.arrival, prefill_queue_s=queue_s,
                              prefill_s=prefill_s, handoff_s=handoff_s)
        self.text_parts.append(text)
        return Delta(text=text, token_ids=tuple(token_ids), accept_lengths=tuple(accept_lengths),
                     finish_reason=finish_reason, prompt_tokens=len(self.prompt_ids),
                     completion_tokens=len(self.token_ids), timings=timings,
                     logprobs=logprobs)
