"""The choices of one HTTP request (prompts × n), run concurrently as separate router requests.

``run_choices`` merges their deltas into one stream in arrival order. The first failure ends the
whole HTTP request; leaving the stream early (a client that went away, a failure) cancels every
choice still running, and each one's cleanup aborts it on its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from router.dispatch import Job
from router.generation import Generation
from router.requests import Delta, OutputTracker


@dataclass(frozen=True)
class Choice:
    """One completion of the HTTP request: its index in ``choices`` and its router request."""

    index: int
    job: Job
    tracker: OutputTracker


@dataclass(frozen=True)
class _Ended:
    index: int
    error: BaseException | None = None


async def run_choices(generation: Generation,
                      choices: Sequence[Choice]) -> AsyncIterator[tuple[int, Delta]]:
    """Yield ``(choice index, delta)`` until every choice has finished.

    Raises the first choice's failure (``DispatchError`` or a bug) as soon as it happens. Close
    this generator (``contextlib.aclosing``) when leaving it early.
    """
    queue: asyncio.Queue[tuple[int, Delta] | _Ended] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async with contextlib.aclosing(generation.run(choice.job, choice.tracker)) as deltas:
                async for delta in deltas:
                    queue.put_nowait((choice.index, delta))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            queue.put_nowait(_Ended(choice.index, exc))
            return
        queue.put_nowait(_Ended(choice.index))

    tasks = [asyncio.create_task(pump(c), name=f"choice-{c.job.spec.request_id}") for c in choices]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if isinstance(item, _Ended):
                if item.error is not None:
                    raise item.error
                running -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()
        # let each choice's cleanup (its aborts) start before the request is gone
        await asyncio.gather(*tasks, return_exceptions=True)
