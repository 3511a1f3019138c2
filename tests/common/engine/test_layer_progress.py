"""LayerProgress: readers wait for the layer they need, and a failed forward wakes them."""

from __future__ import annotations

import threading

import pytest

from common.engine.layer_progress import ForwardFailed, LayerProgress


def test_a_wait_returns_once_its_layer_is_queued():
    progress = LayerProgress(3, cuda=False)
    done = threading.Event()

    def reader():
        progress.wait(1)
        done.set()

    thread = threading.Thread(target=reader)
    thread.start()
    progress.layer_queued(0)
    assert not done.wait(0.05)
    progress.layer_queued(1)
    assert done.wait(5)
    thread.join(5)
    assert progress.wait(0) is None  # the CPU: nothing for a stream to wait on


def test_finish_covers_every_layer_and_fail_wakes_waiters():
    finished = LayerProgress(4, cuda=False)
    finished.finish()
    assert finished.wait(3) is None
    failed = LayerProgress(4, cuda=False)
    failed.layer_queued(0)
    errors = []

    def reader():
        try:
            failed.wait(2)
        except ForwardFailed as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    failed.fail(RuntimeError("device fault"))
    thread.join(5)
    assert len(errors) == 1 and "device fault" in str(errors[0])
    assert failed.wait(0) is None  # layers queued before the failure are still readable


def test_waits_time_out_and_check_the_layer():
    progress = LayerProgress(2, cuda=False)
    with pytest.raises(TimeoutError):
        progress.wait(0, timeout_s=0.01)
    with pytest.raises(ValueError):
        progress.wait(2)


def test_readers_of_different_layers_each_wake_at_their_own_layer():
    progress = LayerProgress(4, cuda=False)
    woke: list[int] = []
    lock = threading.Lock()

    def reader(layer):
        progress.wait(layer)
        with lock:
            woke.append(layer)

    threads = [threading.Thread(target=reader, args=(layer,)) for layer in (3, 1, 2)]
    for thread in threads:
        thread.start()
    for layer in range(4):
        progress.layer_queued(layer)
        for _ in range(500):  # until the reader of this layer has returned
            with lock:
                if layer == 0 or layer in woke:
                    break
            threading.Event().wait(0.01)
        with lock:
            assert woke == [n for n in (1, 2, 3) if n <= layer]  # none early, none late
    for thread in threads:
        thread.join(5)
    # a wait that timed out leaves the progress as it was for later readers
    late = LayerProgress(2, cuda=False)
    with pytest.raises(TimeoutError):
        late.wait(1, timeout_s=0.01)
    late.layer_queued(1)
    assert late.wait(1) is None
