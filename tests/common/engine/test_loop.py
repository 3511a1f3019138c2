"""The engine thread: commands between steps, and a failed step fails every later call."""

from __future__ import annotations

import threading

import pytest

from common.engine.loop import EngineLoop, serial_main_thread


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


def test_a_cancelled_future_never_raises_on_the_engine_thread():
    """What ``asyncio.wrap_future`` does to a future whose awaiting task is cancelled."""
    from concurrent.futures import Future

    from common.engine.loop import resolve

    loop = Counting()
    loop.start()
    try:
        given_up: Future = Future()
        given_up.cancel()
        assert loop.call(resolve, given_up, 1).result(5) is False
        assert loop.call(resolve, given_up, None, RuntimeError("x")).result(5) is False
        fresh: Future = Future()
        assert loop.call(resolve, fresh, 7).result(5) is True and fresh.result() == 7
        assert loop.is_alive
    finally:
        loop.stop()


def test_a_step_failed_for_its_requests_keeps_the_engine_running():
    from common.engine.errors import StepFailed

    class FailingOnce(Counting):
        def __init__(self) -> None:
            super().__init__()
            self.failed: list[list[str]] = []

        def step(self) -> None:
            super().step()
            if self.steps == 2:
                raise StepFailed(["a", "b"], ValueError("bad row"))

        def on_step_failed(self, exc: StepFailed) -> None:
            self.failed.append(exc.request_ids)

    loop = FailingOnce()
    loop.start()
    try:
        loop.call(loop.add, 4).result(5)
        for _ in range(100):
            if loop.call(lambda: loop.steps).result(5) == 4:
                break
        assert loop.call(lambda: loop.steps).result(5) == 4
        assert loop.failed == [["a", "b"]] and loop.is_alive and not loop.fatal.is_set()
    finally:
        loop.stop()


class Idle(EngineLoop):
    def has_work(self) -> bool:
        return False

    def step(self) -> None:
        raise AssertionError("an idle loop never steps")


def test_the_engine_thread_takes_the_cpu_threads_it_is_given():
    import torch

    before = torch.get_num_threads()
    try:
        given = serial_main_thread()
        assert given == before and torch.get_num_threads() == 1
        loop = Idle("threads", cpu_threads=3)
        loop.start()
        try:
            assert loop.call(torch.get_num_threads).result(5) == 3
        finally:
            loop.stop()
        assert torch.get_num_threads() == 1  # the calling thread keeps its own setting
    finally:
        torch.set_num_threads(before)
