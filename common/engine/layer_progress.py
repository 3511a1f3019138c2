"""How far one forward has got, layer by layer, for readers on other threads.

A prefill worker reports what an EXTEND step will make final *before* the step runs, with one
of these: the handoff's reader thread asks :meth:`LayerProgress.wait` for the layer that writes
a piece of state, and gets it as soon as the engine thread has queued that layer (on a GPU, with
a CUDA event recorded behind the layer's kernels for the reader's stream to wait on; on the CPU
a queued layer has run). So a layer's state starts on its way while the forward is still being
launched, not once the whole forward is queued.
"""

from __future__ import annotations

import threading

import torch


class ForwardFailed(RuntimeError):
    """The forward a reader waited on raised before it queued the layer."""


class LayerProgress:
    """Layers ``0..queued-1`` of one forward are queued. The engine thread calls
    :meth:`layer_queued` in order, then :meth:`finish` (or :meth:`fail`); any thread may
    :meth:`wait`."""

    def __init__(self, num_layers: int, cuda: bool) -> None:
        self.num_layers = num_layers
        self._events = [torch.cuda.Event() for _ in range(num_layers)] if cuda else None
        self._queued = 0
        self._failed: BaseException | None = None
        self._lock = threading.Lock()
        # each waiting reader's layer and its own flag: a reader waiting for layer 30 is not
        # woken by layers 0..29 (every wake is a round of GIL hand-offs with the engine
        # thread, whose forward is launch-bound), and the engine thread makes no flags
        self._waiters: list[tuple[int, threading.Event]] = []

    # engine thread
    def layer_queued(self, layer: int) -> None:
        """Layer ``layer``'s work is queued (the forward's ``after_layer``)."""
        if self._events is not None:
            self._events[layer].record()
        self._mark_queued(layer + 1)

    def _mark_queued(self, count: int) -> None:
        with self._lock:
            self._queued = max(self._queued, count)
            if not self._waiters:
                return
            woken = [flag for layer, flag in self._waiters if layer < self._queued]
            self._waiters = [(layer, flag) for layer, flag in self._waiters
                             if layer >= self._queued]
        for flag in woken:
            flag.set()

    def finish(self) -> None:
        """The whole forward is queued. Layers it never reported (a model that does not call
        ``after_layer``) are covered by an event recorded now, after all of them."""
        if self._events is not None and self._queued < self.num_layers:
            last = torch.cuda.Event()
            last.record()
            self._events[self._queued:] = [last] * (self.num_layers - self._queued)
        self._mark_queued(self.num_layers)

    def fail(self, exc: BaseException) -> None:
        """The forward raised: every wait for a layer it did not queue raises now."""
        with self._lock:
            self._failed = exc
            waiters, self._waiters = self._waiters, []
        for _, flag in waiters:
            flag.set()

    # any thread
    def wait(self, layer: int, timeout_s: float = 600.0) -> torch.cuda.Event | None:
        """Block until ``layer`` is queued; then its event (a GPU: the reader's stream waits
        on it), or None (the CPU: the layer has run). Raises ForwardFailed when the forward
        raised first, TimeoutError when nothing happened for ``timeout_s``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        flag = None
        with self._lock:
            if self._queued <= layer and self._failed is None:
                flag = threading.Event()
                self._waiters.append((layer, flag))
        if flag is not None and not flag.wait(timeout_s):
            with self._lock:
                self._waiters = [w for w in self._waiters if w[1] is not flag]
            raise TimeoutError(f"layer {layer} was not queued within {timeout_s} s")
        if self._queued <= layer:  # woken by fail()
            raise ForwardFailed(f"the forward failed before layer {layer}: "
                                f"{self._failed!r}")
        return None if self._events is None else self._events[layer]
