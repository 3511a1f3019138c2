"""feed_from_thread: items in order, bounded run-ahead, producer errors raised to the consumer,
and a consumer that stops early stops the producer."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefill_service.message_feed import feed_from_thread


@pytest.fixture
def executor():
    with ThreadPoolExecutor(max_workers=2) as ex:
        yield ex


def test_items_arrive_in_order_and_production_stays_bounded(executor):
    made = []

    def produce():
        for i in range(50):
            made.append(i)
            yield bytes([i])

    async def consume():
        out = []
        async for item in feed_from_thread(executor, produce, max_ahead=3):
            await asyncio.sleep(0.001)
            # made can run ahead of out by the queue (3), the item being emitted and the one
            # this consumer holds
            assert len(made) - len(out) <= 5
            out.append(item[0])
        return out

    assert asyncio.run(consume()) == list(range(50))


def test_a_producer_error_is_raised_to_the_consumer(executor):
    def produce():
        yield b"a"
        raise ValueError("pool read failed")

    async def consume():
        return [item async for item in feed_from_thread(executor, produce)]

    with pytest.raises(ValueError, match="pool read failed"):
        asyncio.run(consume())


def test_stopping_early_stops_the_producer_before_returning(executor):
    stopped = threading.Event()

    def produce():
        try:
            for i in range(10_000):
                yield b"x"
                time.sleep(0.0005)
        finally:
            stopped.set()

    async def consume():
        feed = feed_from_thread(executor, produce, max_ahead=2)
        async for _ in feed:
            break
        await feed.aclose()
        # no thread reads the pools once the feed is closed
        return stopped.is_set()

    assert asyncio.run(consume())


def test_cancelling_the_consumer_stops_the_producer(executor):
    stopped = threading.Event()

    def produce():
        try:
            while True:
                yield b"x"
        finally:
            stopped.set()

    async def consume():
        async def drain():
            async with contextlib.aclosing(feed_from_thread(executor, produce, 1)) as feed:
                async for _ in feed:
                    await asyncio.sleep(0.01)
        task = asyncio.ensure_future(drain())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return stopped.is_set()

    assert asyncio.run(consume())


def test_max_ahead_must_be_positive(executor):
    async def consume():
        async for _ in feed_from_thread(executor, lambda: [], max_ahead=0):
            pass

    with pytest.raises(ValueError):
        asyncio.run(consume())
