"""Which requests run in the next forward, and the cache they own. Pure CPU bookkeeping.

Policy (as in SGLang and vLLM): prompts first. A step is either EXTEND (prefill chunks of waiting
or partly prefilled requests, under a token budget) or DECODE (one token for every running
request). Pages for a request's whole budget (prompt + max_new_tokens) are reserved when it is
admitted, so a running request can never run out of cache mid-way and nothing has to be evicted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.cache.cache_manager import CacheManager, RequestTooLarge, RoomPolicy
from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool
from common.engine.request import Request, RequestStatus
from common.model.forward_batch import ForwardMode

__all__ = ["RequestTooLarge", "ScheduledStep", "Scheduler", "SchedulerConfig",
           "default_max_prefill_tokens"]


def default_max_prefill_tokens(device: str) -> int:
    """The prefill chunk a worker takes when none is given: 8192 tokens on a GPU, 2048 on the CPU.

    On a GPU a chunk's host work (launching about 800 kernels for a Qwen3.5-4B shape) costs the
    same whatever its length, so a 2048-token chunk leaves the GPU idle about a third of the
    time: on an H200 a 32k prompt took 926-1,162 ms in 2048-token chunks against 589 ms of
    kernel time, and 634 ms in 8192-token chunks (docs/handoff_performance.md, run E). SGLang
    and vLLM default to 8192 or more on GPUs of this size. On the CPU the forward is the cost,
    and a smaller chunk keeps a worker's start-up warm-up short."""
    import torch

    return 8192 if torch.device(device).type == "cuda" else 2048


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 2048  # token budget of one EXTEND step (the prefill chunk size)
    max_running_requests: int = 64
    # decode and local engines reserve pages for prompt + max_new_tokens at admission; a
    # prefill worker only ever writes the prompt
    reserve_output_tokens: bool = True
    # extra positions a speculative verify block may write past the committed tokens
    lookahead_tokens: int = 0


@dataclass
class ScheduledStep:
    """One forward's work: requests with the number of new tokens each feeds in."""

    mode: ForwardMode
    requests: list[Request]
    num_new_tokens: list[int]

    def token_ids(self) -> list[list[int]]:
        return [[r.token_at(p) for p in range(r.num_cached, r.num_cached + n)]
                for r, n in zip(self.requests, self.num_new_tokens)]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_pool: KVPool,
                 state_pool: GDNStatePool) -> None:
        if config.max_prefill_tokens < 1 or config.max_running_requests < 1:
            raise ValueError("scheduler limits must be positive")
        self.config = config
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        # the pools' one owner: handoffs take their room through it too
        self.cache = CacheManager(kv_pool, state_pool, RoomPolicy(
            config.reserve_output_tokens, config.lookahead_tokens))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def pages_needed(self, request: Request) -> int:
        return self.cache.pages_for(len(request.prompt_ids), request.params.max_new_tokens)

    def check_fits(self, request: Request) -> None:
        """Raise :class:`RequestTooLarge` if the request could never be admitted."""
        self.pages_needed(request)

    def add(self, request: Request) -> None:
        self.check_fits(request)
        self.waiting.append(request)

    def admit_prefilled(self, request: Request) -> None:
        """Take a request whose cache is already filled (pages and slot owned by it)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def reserve(self, request: Request) -> bool:
        """Give a request a state slot and pages for its whole budget, if both are free."""
        pages = self.pages_needed(request)
        if not self.cache.can_take(pages):
            return False
        room = self.cache.take(pages, zero_state=True)
        request.page_ids, request.slot = room.page_ids, room.slot
        request.status = RequestStatus.RUNNING
        return True

    def detach(self, request: Request) -> None:
        """Take a request out of the batch but leave it its cache (release() frees it)."""
        if request in self.running:
            self.running.remove(request)

    def release(self, request: Request) -> None:
        """Return a request's pages and slot (idempotent) and drop it from the queues."""
        self.cache.give_back(request.page_ids, request.slot)
        request.page_ids, request.slot = [], None
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    def can_schedule(self) -> bool:
        """Whether :meth:`schedule` would return a step now (a running request to advance, or
        room to admit the first waiting one); an engine thread sleeps while this is False."""
        if self.running:
            return True
        if not self.waiting or len(self.running) >= self.config.max_running_requests:
            return False
        return self.cache.can_take(self.pages_needed(self.waiting[0]))

    def schedule(self) -> ScheduledStep | None:
        step = self._schedule_extend()
        if step is not None:
            return step
        decoding = [r for r in self.running if not r.is_prefilling]
        if not decoding:
            return None
        return ScheduledStep(ForwardMode.DECODE, decoding, [1] * len(decoding))

    def _schedule_extend(self) -> ScheduledStep | None:
        budget = self.config.max_prefill_tokens
        requests, counts = [], []
        # partly prefilled requests continue first: they already hold cache
        for r in self.running:
            if r.is_prefilling and budget > 0:
                n = min(len(r.prompt_ids) - r.num_cached, budget)
                requests.append(r)
                counts.append(n)
                budget -= n
        while (self.waiting and budget > 0
               and len(self.running) < self.config.max_running_requests):
            r = self.waiting[0]
            if not self.reserve(r):
                break
            self.waiting.popleft()
            self.running.append(r)
            n = min(len(r.prompt_ids), budget)
            requests.append(r)
            counts.append(n)
            budget -= n
        if not requests:
            return None
        return ScheduledStep(ForwardMode.EXTEND, requests, counts)
