"""A dedicated thread that owns an engine: other threads reach it only through commands.

Pools, schedulers and the model are touched by this thread alone, so they need no locks, and the
asyncio event loop of a service never runs model work.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

import torch

from common.engine.errors import StepFailed

log = logging.getLogger(__name__)


def resolve(future: Future, value: Any = None, error: BaseException | None = None) -> bool:
    """Settle ``future`` unless its caller has already given up on it (cancelled it, as
    ``asyncio.wrap_future`` does when the awaiting task is cancelled). False if it was settled
    before: a cancelled request must never raise on the engine thread."""
    if future.done():
        return False
    try:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)
    except InvalidStateError:  # cancelled from another thread between the check and here
        return False
    return True


def serial_main_thread() -> int:
    """Give the calling (main) thread one torch CPU thread, and return how many torch would
    have used, for the engine thread (``EngineConfig.cpu_threads``). Call it before the main
    thread runs any torch op.

    OpenMP keeps a team of threads for each thread that ran a parallel region. Once the main
    thread has one (loading the model makes it), a parallel region on the engine thread runs
    about half as fast on a 2-core host as the same region on the main thread (measured:
    ``benchmarks/prefill_gap.py --device cpu``). With one thread the main thread makes no team,
    and the engine thread's regions run at the main thread's speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


class EngineLoop(ABC):
    """Subclasses implement :meth:`has_work` and :meth:`step`; :meth:`call` runs a function on
    the engine thread between steps and returns a future of its result. ``cpu_threads``: the
    engine thread's torch CPU threads (None: torch's setting, as the creating thread has it)."""

    def __init__(self, name: str, cpu_threads: int | None = None) -> None:
        self._cpu_threads = cpu_threads
        self._commands: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        if self._stopping.is_set():
            future.set_exception(RuntimeError("engine is stopped"))
            return future
        self._commands.put((fn, args, future))
        return future

    @abstractmethod
    def has_work(self) -> bool:
        """Whether a step now would compute something (else the thread sleeps until a call)."""

    @abstractmethod
    def step(self) -> None:
        """One unit of engine work, on the engine thread."""

    def on_step_failed(self, exc: StepFailed) -> None:
        """A step failed for ``exc.request_ids`` only (already ended and freed): tell their
        callers."""

    def fail(self, exc: BaseException) -> None:
        """From a command on the engine thread: the engine cannot go on (a tensor-parallel
        group out of step after a collective outside a step). It stops as after a step that
        raised: later calls fail, the loop ends, :meth:`on_fatal` tells the callers."""
        log.error("engine failed: %s", exc)
        self.error = exc
        self._stopping.set()
        self.on_fatal(exc)

    def on_fatal(self, exc: BaseException) -> None:
        """Called once if a step raises anything but :class:`StepFailed`: the engine state (or
        the device) can no longer be trusted."""

    def _run_command(self, item) -> None:
        fn, args, future = item
        if not future.set_running_or_notify_cancel():
            return
        try:
            value = fn(*args)
        except BaseException as exc:  # handed to the caller, not raised here
            resolve(future, error=exc)
        else:
            resolve(future, value)

    def _run(self) -> None:
        if self._cpu_threads is not None:
            torch.set_num_threads(self._cpu_threads)
        while not self._stopping.is_set():
            try:
                item = self._commands.get(timeout=None if not self.has_work() else 0)
            except queue.Empty:
                item = False
            if item is None:
                break
            if item:
                self._run_command(item)
                continue  # drain all pending commands before the next step
            try:
                self.step()
            except StepFailed as exc:
                # those requests are ended and freed; the engine and the others go on
                self.on_step_failed(exc)
            except BaseException as exc:
                log.exception("engine step failed")
                self.error = exc
                self._stopping.set()  # later calls fail at once instead of waiting forever
                self.on_fatal(exc)
                break
        # fail whatever is still queued so no caller waits forever
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item:
                resolve(item[2], error=RuntimeError("engine stopped"))
