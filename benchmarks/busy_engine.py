"""A stand-in for a prefill worker's engine thread while it launches a forward: a thread that
runs small torch operations back to back, holding the GIL the way kernel launches hold it.

A handoff's sending threads live in the same process as the engine thread and take the GIL
after each call that released it (a checksum, a ``sendmsg``, a wait): while the engine thread
launches kernels, each such return waits for the interpreter's switch interval. On a GPU a
prefill forward is bound by its host's launching (``docs/handoff_performance.md``), so this is
the condition the sender meets there, made on any machine. ``ops_per_s`` against a run alone
says what the sending threads cost the engine.
"""

from __future__ import annotations

import threading
import time

import torch


class BusyEngine:
    """``with BusyEngine() as busy:`` runs the thread for the block; ``busy.ops_per_s`` after."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._ops = 0
        self._seconds = 0.0
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        a, b = torch.ones(8), torch.ones(8)
        out = torch.empty(8)
        start = time.perf_counter()
        while not self._stop.is_set():
            for _ in range(64):
                torch.add(a, b, out=out)
            self._ops += 64
        self._seconds = time.perf_counter() - start

    def __enter__(self) -> BusyEngine:
        self._thread = threading.Thread(target=self._run, name="busy-engine", daemon=True)
        self._thread.start()
        time.sleep(0.01)  # running before the measured work starts
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def ops_per_s(self) -> float:
        return self._ops / self._seconds if self._seconds else 0.0


def solo_ops_per_s(seconds: float = 0.3) -> float:
    """The thread's rate with nothing else running, the baseline of ``ops_per_s``."""
    with BusyEngine() as busy:
        time.sleep(seconds)
    return busy.ops_per_s
