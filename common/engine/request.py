"""Per-request state the engine keeps: tokens, cache ownership, progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from common.logprobs import TokenLogprobs
from common.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # holds no cache yet
    RUNNING = "running"    # owns pages and a state slot; prefilling or decoding
    FINISHED = "finished"  # resources returned


@dataclass(eq=False)
class Request:
    """One generation request.

    ``num_cached`` counts tokens whose KV and GDN state are already in the pools; a request is
    prefilling while ``num_cached < len(prompt_ids)``. During decode the newest token is always
    the one not yet cached.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    page_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    speculative: bool = False  # decoded with DFLASH steps (its draft context is kept)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per DFLASH step
    # one per output token when params.logprobs is set (the first one too, after a handoff)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]
