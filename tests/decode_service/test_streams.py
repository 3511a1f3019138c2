"""decode_service/streams.py: a step's events reach the loop in one wake-up, in order, and
channels nobody takes expire."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.engine.llm_engine import TokenEvent
from decode_service.streams import TokenStreams


class _CountingLoop:
    """Records what the engine thread hands the loop, to run it by hand."""

    def __init__(self) -> None:
        self.calls: list = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.calls.append((fn, args))

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)


def _step(n_first: int) -> list[TokenEvent]:
    # a DFLASH step of request 7 (three tokens) beside a plain step of request 9, which ends
    return [TokenEvent("7", 11, None, accept_length=3), TokenEvent("7", 12, None),
            TokenEvent("7", n_first, None), TokenEvent("9", 40, "length")]


def _drain(queue: asyncio.Queue) -> list[int]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait().token_id)
    return out


def test_a_steps_events_reach_the_loop_in_one_call_and_keep_their_order():
    loop = _CountingLoop()
    streams = TokenStreams(loop)
    seven = streams.subscribe(7)
    streams.post(_step(13))
    assert len(loop.calls) == 1  # one wake-up for the whole step
    loop.run()
    assert _drain(seven) == [11, 12, 13]
    nine = streams.subscribe(9)  # the stream may open after its tokens came
    assert _drain(nine) == [40]
    with pytest.raises(ValueError, match="already has a stream"):
        streams.subscribe(9)


def test_finished_channels_nobody_took_expire_and_so_do_aborted_ids():
    loop = _CountingLoop()
    streams = TokenStreams(loop, ttl_s=0.0)
    streams.post([TokenEvent("5", 1, "stop")])
    loop.run()
    streams.mark_aborted(6)
    assert streams.is_aborted(6)
    streams.post([TokenEvent("8", 2, None)])  # any later delivery sweeps the expired ones
    loop.run()
    assert not streams.is_aborted(6)
    assert _drain(streams.subscribe(5)) == []  # a new channel: the old one was dropped
    assert _drain(streams.subscribe(8)) == [2]


def test_events_posted_from_another_thread_arrive_on_a_running_loop():
    async def main():
        streams = TokenStreams(asyncio.get_running_loop())
        queue = streams.subscribe(7)
        thread = threading.Thread(target=streams.post, args=(_step(13),))
        thread.start()
        got = [(await asyncio.wait_for(queue.get(), 5)).token_id for _ in range(3)]
        thread.join()
        return got

    assert asyncio.run(main()) == [11, 12, 13]
