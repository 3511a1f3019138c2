"""Whether a call releases the GIL: another thread counts while it runs.

With a long switch interval, a call that held the GIL for its whole length leaves the
counter still; one that released it lets the counter move the whole time."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def counter_moves(call: Callable[[], object], times: int = 2) -> list[int]:
    """How far the other thread's counter moved during each of ``times`` calls of ``call``."""
    counter = [0]
    done = threading.Event()

    def spin():
        while not done.is_set():
            counter[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    thread = threading.Thread(target=spin)
    thread.start()
    moved = []
    try:
        for _ in range(times):
            before = counter[0]
            call()
            moved.append(counter[0] - before)
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    return moved
