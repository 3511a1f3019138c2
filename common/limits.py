"""Bounds on what one request may ask for, checked alike by the router and the workers.

Each bound caps work or memory that a single caller could otherwise make a server spend on it:
stop ids are compared with every generated token, and the request id is echoed in every log line
and every streamed message. A request beyond a bound is the caller's mistake (ValueError, which
the servicers answer with INVALID_ARGUMENT), never something to truncate silently.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_STOP_TOKEN_IDS = 1024
MAX_REQUEST_ID_BYTES = 256


def unique_stop_token_ids(ids: Iterable[int]) -> tuple[int, ...]:
    """``ids`` without repeats, in first-seen order; ValueError when more than
    ``MAX_STOP_TOKEN_IDS`` distinct ids remain."""
    unique = tuple(dict.fromkeys(ids))
    if len(unique) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} distinct stop_token_ids are accepted, "
                         f"got {len(unique)}")
    return unique


def check_request_id(request_id: str) -> None:
    """ValueError when ``request_id`` is longer than ``MAX_REQUEST_ID_BYTES`` in UTF-8."""
    size = len(request_id.encode("utf-8", "surrogatepass"))
    if size > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request_id may have at most {MAX_REQUEST_ID_BYTES} bytes, "
                         f"got {size}")


def request_capacity_tokens(engine) -> int:
    """The most token positions (prompt plus generated tokens, as the engine reserves them) that
    one request can ever hold in ``engine``'s KV pool, even with every page free.

    ``engine`` is a ``common.engine.llm_engine.LLMEngine``. A prefill engine reserves the prompt
    only; a decode engine the prompt, ``max_new_tokens`` and the speculative lookahead.
    """
    scheduler = engine.scheduler
    pool = engine.kv_pool
    tokens = pool.allocator.num_usable * pool.page_size
    if scheduler.config.reserve_output_tokens:
        tokens -= scheduler.config.lookahead_tokens
    return max(tokens, 0)
