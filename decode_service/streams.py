"""Per-request token queues between the engine thread and ``Decode.Stream`` calls, and the
record of aborted handoff ids. Lives on the asyncio loop; the engine thread only posts."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common.engine.llm_engine import TokenEvent


@dataclass
class _Channel:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished_at: float | None = None
    subscribed: bool = False


class TokenStreams:
    """A channel per handoff id, created by whichever comes first: the handoff or the Stream call
    (the router opens the stream before it starts the prefill, so either order happens).

    Finished channels nobody subscribed to are dropped after ``ttl_s``; so are ids in the abort
    record, which refuses handoffs that arrive after their request was aborted.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, ttl_s: float = 120.0) -> None:
        self._loop = loop
        self._ttl_s = ttl_s
        self._channels: dict[int, _Channel] = {}
        self._aborted: dict[int, float] = {}

    # engine thread (or the loop)
    def post(self, events: list[TokenEvent]) -> None:
        """Hand the loop one step's events at once: the loop wakes once per step, not once per
        token, and each stream then finds all of its request's tokens of the step queued (one
        message, where a DFLASH step commits several)."""
        self._loop.call_soon_threadsafe(self._deliver, events)

    # event loop
    def _deliver(self, events: list[TokenEvent]) -> None:
        self._expire()
        now = time.monotonic()
        for event in events:
            channel = self._channel(int(event.request_id))
            channel.queue.put_nowait(event)
            if event.finish_reason is not None:
                channel.finished_at = now

    def _channel(self, handoff_id: int) -> _Channel:
        channel = self._channels.get(handoff_id)
        if channel is None:
            channel = self._channels[handoff_id] = _Channel()
        return channel

    def subscribe(self, handoff_id: int) -> asyncio.Queue:
        self._expire()
        channel = self._channel(handoff_id)
        if channel.subscribed:
            raise ValueError(f"handoff {handoff_id} already has a stream")
        channel.subscribed = True
        return channel.queue

    def close(self, handoff_id: int) -> None:
        self._channels.pop(handoff_id, None)

    def mark_aborted(self, handoff_id: int) -> None:
        self._expire()
        self._aborted[handoff_id] = time.monotonic()

    def is_aborted(self, handoff_id: int) -> bool:
        return handoff_id in self._aborted

    def _expire(self) -> None:
        cutoff = time.monotonic() - self._ttl_s
        for hid in [h for h, c in self._channels.items()
                    if c.finished_at is not None and c.finished_at < cutoff and not c.subscribed]:
            del self._channels[hid]
        for hid in [h for h, t in self._aborted.items() if t < cutoff]:
            del self._aborted[hid]
