"""The engine thread: commands between steps, and a failed step fails every later call."""

from __future__ import annotations

import threading

import pytest

from common.engine.loop import EngineLoop


class Counting(EngineLoop):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__("test-engine")
        self.steps, self.todo, self.fail_at = 0, 0, fail_at
        self.fatal = threading.Event()

    def has_work(self) -> bool:
        return self.todo > 0

    def step(self) -> None:
        self.steps += 1
        self.todo -= 1
        if self.steps == self.fail_at:
            raise RuntimeError("boom")

    def on_fatal(self, exc: BaseException) -> None:
        self.fatal.set()

    def add(self, n: int) -> None:
        self.todo += n


def test_commands_run_on_the_engine_thread_between_steps():
    loop = Counting()
    loop.start()
    try:
        assert loop.call(lambda: threading.current_thread().name).result(5) == "test-engine"
        loop.call(loop.add, 3).result(5)
        assert loop.call(lambda: loop.steps).result(5) <= 3
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda: 1 / 0).result(5)  # a failing command fails only its caller
        assert loop.is_alive
    finally:
        loop.stop()


def test_a_failed_step_stops_the_engine_and_fails_later_calls():
    loop = Counting(fail_at=2)
    loop.start()
    loop.call(loop.add, 5).result(5)
    assert loop.fatal.wait(5)
    loop._thread.join(5)
    assert not loop.is_alive and isinstance(loop.error, RuntimeError)
    with pytest.raises(RuntimeError, match="stopped"):
        loop.call(lambda: None).result(1)  # answered at once, not left waiting
