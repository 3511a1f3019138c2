"""How large a request the router takes: its own caps, and what the workers can ever hold.

Every check raises ValueError, which both public APIs answer as the caller's mistake
(INVALID_ARGUMENT, HTTP 400), before any worker is involved:

- ``check_text_size``: a text prompt's UTF-8 bytes, before it is tokenized (``--max-prompt-bytes``);
- ``check_request_size``: the prompt's tokens against ``--max-prompt-tokens`` and the largest
  prompt a healthy prefill worker's pool holds; prompt plus ``max_new_tokens`` against the
  largest request a healthy decode worker's pool holds (``LoadReport.max_request_tokens``).
  A request that no worker could hold even with every page free would otherwise be refused for
  lack of room (RESOURCE_EXHAUSTED) on every attempt, as if waiting could help.

The request id and the stop ids have fixed caps shared with the workers (``common/limits.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.sampling import SamplingParams

# About 500k tokens of English, twice the longest context of the models served.
DEFAULT_MAX_PROMPT_BYTES = 2 << 20
# gRPC's own default; holds a prompt of DEFAULT_MAX_PROMPT_BYTES, or ~1M token ids, with room.
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


@dataclass(frozen=True)
class RequestLimits:
    """The router's own caps on one request (its ``--max-*`` flags).

    ``max_prompt_tokens`` 0 means as many as the workers' pools hold.
    ``max_message_bytes`` caps each request message on the public gRPC port.
    """

    max_prompt_tokens: int = 0
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 0:
            raise ValueError(f"--max-prompt-tokens must be >= 0 (0 = what the workers hold), "
                             f"got {self.max_prompt_tokens}")
        if self.max_prompt_bytes < 1:
            raise ValueError(f"--max-prompt-bytes must be >= 1, got {self.max_prompt_bytes}")
        if self.max_message_bytes < self.max_prompt_bytes:
            raise ValueError(f"--max-message-bytes ({self.max_message_bytes}) must be at least "
                             f"--max-prompt-bytes ({self.max_prompt_bytes}): a message carries "
                             f"the prompt")


@dataclass(frozen=True)
class WorkerCapacity:
    """The longest requests some healthy worker could ever hold; None where none has said."""

    prompt_tokens: int | None = None  # a prefill worker: the prompt
    request_tokens: int | None = None  # a decode worker: prompt + max_new_tokens

    @classmethod
    def of(cls, workers: Iterable) -> WorkerCapacity:
        """From the registry's rows (``kind``, ``healthy``, ``load``): the largest each kind
        reports, counting healthy workers only."""
        best: dict[str, int] = {}
        for w in workers:
            size = w.load.max_request_tokens if w.healthy and w.load is not None else 0
            if size > 0:
                best[w.kind] = max(best.get(w.kind, 0), size)
        return cls(prompt_tokens=best.get("prefill"), request_tokens=best.get("decode"))


def check_text_size(text: str, limits: RequestLimits) -> None:
    """ValueError when ``text`` is longer than ``max_prompt_bytes`` in UTF-8."""
    # a str holds at most 4 bytes per character: most prompts need no encoding to be cleared
    if 4 * len(text) <= limits.max_prompt_bytes:
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_prompt_bytes:
        raise ValueError(f"the prompt text has {size} bytes; at most "
                         f"{limits.max_prompt_bytes} are accepted (--max-prompt-bytes)")


def check_request_size(ids: Sequence[int], params: SamplingParams, limits: RequestLimits,
                       capacity: WorkerCapacity) -> None:
    """ValueError when the prompt, or the prompt with its ``max_new_tokens``, is longer than
    the router takes or than any worker could ever hold."""
    n = len(ids)
    if limits.max_prompt_tokens and n > limits.max_prompt_tokens:
        raise ValueError(f"the prompt has {n} tokens; at most {limits.max_prompt_tokens} are "
                         f"accepted (--max-prompt-tokens)")
    if capacity.prompt_tokens is not None and n > capacity.prompt_tokens:
        raise ValueError(f"the prompt has {n} tokens; the largest prefill worker holds "
                         f"{capacity.prompt_tokens}")
    total = n + params.max_new_tokens
    if capacity.request_tokens is not None and total > capacity.request_tokens:
        raise ValueError(f"the prompt ({n} tokens) plus max_new_tokens "
                         f"({params.max_new_tokens}) needs {total} token positions; the "
                         f"largest decode worker holds {capacity.request_tokens}")
