"""Messages made on a worker thread, written by the event loop as they come.

A handoff's chunks are read out of the pools and encoded on a sender thread; writing each one as
soon as it exists (instead of after the whole part is encoded) overlaps encoding with the wire.
The thread blocks once ``max_ahead`` messages wait to be written, which bounds the memory of
encoded copies; when the loop stops consuming (the call failed or was cancelled), the thread's
next ``emit`` raises ``FeedClosed`` and the producer unwinds.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Executor

_DONE = object()


class FeedClosed(Exception):
    """The consumer went away; the producer should stop."""


async def feed_from_thread(executor: Executor, produce: Callable[[], Iterable[bytes]],
                           max_ahead: int = 8) -> AsyncIterator[bytes]:
    """Iterate ``produce()`` on ``executor`` and yield its items on the event loop, at most
    ``max_ahead`` ahead of the consumer. An exception of the producer is raised here. Use it
    under ``contextlib.aclosing``: closing waits until the producer has stopped."""
    if max_ahead < 1:
        raise ValueError(f"max_ahead must be >= 1, got {max_ahead}")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    room = threading.Semaphore(max_ahead)
    closed = threading.Event()

    def run() -> None:
        try:
            for item in produce():
                while not room.acquire(timeout=0.1):
                    if closed.is_set():
                        raise FeedClosed()
                if closed.is_set():
                    raise FeedClosed()
                loop.call_soon_threadsafe(queue.put_nowait, item)
        except FeedClosed:
            return
        except BaseException as exc:  # handed to the consumer
            if not closed.is_set():
                loop.call_soon_threadsafe(queue.put_nowait, _Failure(exc))
            return
        if not closed.is_set():
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    worker = loop.run_in_executor(executor, run)
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, _Failure):
                raise item.exc
            room.release()
            yield item
    finally:
        closed.set()
        room.release()  # wake a producer blocked on room, if any, to see ``closed``
        if not worker.done():
            # the producer stops at its next item; wait so no thread still reads the pools
            await asyncio.shield(worker)


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
