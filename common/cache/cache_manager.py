"""The one owner of a worker's pool bookkeeping: room for a request's whole budget.

Two paths take room from the same pools: local scheduling (a prompt admitted to run here, its
state computed here) and handoffs (a decode worker reserving at a header, before the prompt is
prefilled elsewhere). Both go through a :class:`CacheManager`, so the size of a request's room,
the check that it can ever fit, and giving it back are written once. It is used on the engine
thread only (the pools' allocators are not thread-safe); other threads ask the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool


class RequestTooLarge(ValueError):
    """A request that could never fit in this engine's pools."""


@dataclass(frozen=True)
class RoomPolicy:
    """How much room a request is given when it is admitted.

    Attributes:
        reserve_output_tokens: pages for prompt + max_new_tokens (decode and local engines);
            False on a prefill worker, which only ever writes the prompt.
        lookahead_tokens: extra positions a speculative verify block may write past the
            committed tokens.
    """

    reserve_output_tokens: bool = True
    lookahead_tokens: int = 0


@dataclass(frozen=True)
class Room:
    """KV pages and a GDN state slot held for one request."""

    page_ids: list[int]
    slot: int


class CacheManager:
    """Takes and gives back :class:`Room` in ``kv_pool`` and ``state_pool`` (engine thread)."""

    def __init__(self, kv_pool: KVPool, state_pool: GDNStatePool, policy: RoomPolicy) -> None:
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.policy = policy

    def pages_for(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV pages a request of this size is given; RequestTooLarge when it could never be
        given them."""
        p = self.policy
        tokens = (prompt_len + max_new_tokens + p.lookahead_tokens if p.reserve_output_tokens
                  else prompt_len)
        pages = self.kv_pool.pages_for(tokens)
        if pages > self.kv_pool.allocator.num_usable:
            raise RequestTooLarge(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} needs "
                f"{pages} KV pages; the pool has {self.kv_pool.allocator.num_usable}")
        return pages

    def can_take(self, pages: int) -> bool:
        """Whether ``pages`` pages and a state slot are free now."""
        return (self.kv_pool.allocator.can_allocate(pages)
                and self.state_pool.allocator.can_allocate(1))

    def take(self, pages: int, *, zero_state: bool) -> Room:
        """``pages`` pages and a slot; ``OutOfResources`` (nothing taken) when either is short.
        ``zero_state``: a prompt computed here starts from zero state; a handoff's slot is
        overwritten by the bytes that arrive, so it is left as it is."""
        page_ids = self.kv_pool.allocator.allocate(pages)
        try:
            slot = (self.state_pool.allocate() if zero_state
                    else self.state_pool.allocator.allocate(1)[0])
        except BaseException:
            self.kv_pool.allocator.free(page_ids)
            raise
        return Room(page_ids, slot)

    def give_back(self, page_ids: list[int], slot: int | None) -> None:
        """Free a request's pages and slot (a slot of None: it had none yet)."""
        if page_ids:
            self.kv_pool.allocator.free(page_ids)
        if slot is not None:
            self.state_pool.free(slot)
