"""What one request is, in the form every stage from the router to decode holds it."""

from __future__ import annotations

from dataclasses import dataclass

from common.sampling import SamplingParams


@dataclass(frozen=True)
class RequestSpec:
    """One request: the client's id (for logs; it keys nothing on the workers), the prompt, and
    how it samples and stops (``sampling``, the speculative choice and stop token ids included).

    The router's job, the prefill job, the handoff header and the handed-off payload each hold
    one, so a new per-request setting is a ``SamplingParams`` field and one entry in
    ``common/convert.py``, not a field in every stage. Stop strings are not here: they are
    matched on text, which only the router has.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams

    def __post_init__(self) -> None:
        # callers hand lists (a decoded proto field, a tokenizer's output); the spec keeps a
        # tuple so that it stays immutable
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)
