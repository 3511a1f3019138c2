"""A bounded, reusable pool of (pinned) host memory for staging handoff bytes.

Device-to-host copies are asynchronous only into page-locked memory, and page-locking is slow
(cudaHostAlloc takes milliseconds per call and serialises with the GPU), so the pool pins one
region once, at construction, and hands out pieces of it. The engine thread acquires a piece
and starts a copy into it; a sender thread releases it once its bytes are on the wire. On a
decode worker the ``tcp`` listener's reader threads read frames into one, and a frame's buffer
is released once its chunk has landed (``decode_service/tcp_listener.py``).

Exhaustion: ``acquire`` waits (in arrival order) until enough bytes are released, which paces
a producer to the network while total memory stays bounded, and raises ``HostBufferExhausted``
after its timeout; ``try_acquire`` never waits and returns None, for a thread that must not
block (the engine thread keeps the data on the device and tries again later). A request larger
than the whole pool raises ValueError at once, as it could never be served.
"""

from __future__ import annotations

import bisect
import collections
import operator
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch


class HostBufferExhausted(TimeoutError):
    """``acquire`` waited its whole timeout and the pool never had room."""


class HostBufferPoolClosed(RuntimeError):
    """The pool was closed before, or while, ``acquire`` waited."""


@dataclass(frozen=True)
class HostBufferPoolConfig:
    """``capacity_bytes``: the pool's total size, allocated once. ``alignment``: every buffer
    starts at a multiple of it (4096: page aligned, fine for DMA and any dtype view), and sizes
    are rounded up to it. ``pin_memory``: page-lock the pool (None: when CUDA is available)."""

    capacity_bytes: int
    alignment: int = 4096
    pin_memory: bool | None = None

    def __post_init__(self) -> None:
        if self.capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {self.capacity_bytes}")
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {self.alignment}")


class HostBuffer:
    """``nbytes`` bytes of a ``HostBufferPool``, the caller's from ``acquire`` to ``release``.

    ``tensor`` is a uint8 CPU tensor of exactly ``nbytes`` (pinned when the pool is); reading
    or writing it after ``release`` races with whoever acquires those bytes next.
    """

    __slots__ = ("tensor", "offset", "nbytes", "_pool")

    def __init__(self, pool: HostBufferPool, tensor: torch.Tensor, offset: int) -> None:
        self._pool = pool
        self.tensor = tensor
        self.offset = offset
        self.nbytes = tensor.numel()

    def numpy(self) -> np.ndarray:
        """The same bytes as a writable uint8 ndarray (no copy)."""
        return self.tensor.numpy()

    def release(self) -> None:
        """Give the bytes back to the pool (see ``HostBufferPool.release``)."""
        self._pool.release(self)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"HostBuffer(offset={self.offset}, nbytes={self.nbytes})"


class HostBufferPool:
    """Pieces of one host allocation of ``config.capacity_bytes``, handed out first-fit.

    Thread-safe: any thread may acquire and any thread may release. Waiters are served in
    arrival order, so a large request is not starved by a stream of small ones (and a small one
    behind it waits too, until the large one is served).
    """

    def __init__(self, config: HostBufferPoolConfig) -> None:
        pin = torch.cuda.is_available() if config.pin_memory is None else config.pin_memory
        if pin and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (torch.cuda.is_available() is False)")
        self._config = config
        self._pinned = pin
        raw = torch.empty(config.capacity_bytes + config.alignment - 1, dtype=torch.uint8,
                          pin_memory=pin)
        pad = -raw.data_ptr() % config.alignment  # pinned memory is page aligned already
        self._slab = raw[pad:pad + config.capacity_bytes]
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # free ranges, sorted and never adjacent (release merges neighbours)
        self._free_starts: list[int] = [0]
        self._free_ends: list[int] = [config.capacity_bytes]
        self._live: dict[int, HostBuffer] = {}   # offset -> the buffer handed out there
        self._reserved: dict[int, int] = {}       # offset -> bytes taken (size rounded up)
        self._waiters: collections.deque[object] = collections.deque()
        self._in_use = 0
        self._closed = False

    @property
    def config(self) -> HostBufferPoolConfig:
        return self._config

    @property
    def pinned(self) -> bool:
        """Whether the pool's memory is page-locked."""
        return self._pinned

    @property
    def capacity_bytes(self) -> int:
        return self._config.capacity_bytes

    @property
    def bytes_in_use(self) -> int:
        """Bytes handed out and not yet released (sizes rounded up to the alignment)."""
        with self._lock:
            return self._in_use

    @property
    def num_buffers(self) -> int:
        """Buffers handed out and not yet released."""
        with self._lock:
            return len(self._live)

    def acquire(self, nbytes: int, timeout: float | None = None) -> HostBuffer:
        """A buffer of exactly ``nbytes``, waiting up to ``timeout`` seconds (None: for ever)
        for room. Raises ValueError for ``nbytes`` < 1 or larger than the pool,
        ``HostBufferExhausted`` on timeout, ``HostBufferPoolClosed`` if the pool is closed."""
        size = self._size(nbytes)
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_open()
            ticket = object()
            self._waiters.append(ticket)
            try:
                while True:
                    if self._waiters[0] is ticket:
                        offset = self._take(size)
                        if offset is not None:
                            return self._hand_out(offset, nbytes, size)
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise HostBufferExhausted(
                            f"no room for {nbytes} bytes within {timeout} s "
                            f"({self._in_use} of {self.capacity_bytes} bytes in use, "
                            f"{len(self._waiters) - 1} other waiters)")
                    self._cond.wait(remaining)
                    self._check_open()
            finally:
                self._waiters.remove(ticket)
                self._cond.notify_all()  # the next waiter in line may fit now

    def try_acquire(self, nbytes: int) -> HostBuffer | None:
        """A buffer of exactly ``nbytes`` if one is free now and nobody waits before us, else
        None; never blocks. Raises like ``acquire`` for bad sizes and a closed pool."""
        size = self._size(nbytes)
        with self._lock:
            self._check_open()
            if self._waiters:
                return None
            offset = self._take(size)
            return None if offset is None else self._hand_out(offset, nbytes, size)

    def acquire_now(self, nbytes: int, *, closed_ok: bool = False
                    ) -> tuple[torch.Tensor, HostBuffer | None]:
        """``nbytes`` of host memory at once, never waiting: a buffer of the pool when one is
        free now (its ``tensor``, and the buffer to release), else a fresh uint8 tensor pinned
        like the pool, and None (a request larger than the pool too; torch's caching host
        allocator keeps a pinned block for the next one). Raises ``HostBufferPoolClosed`` once
        the pool is closed, unless ``closed_ok`` (then the memory is fresh)."""
        buffer = None
        if nbytes <= self.capacity_bytes:
            try:
                buffer = self.try_acquire(nbytes)
            except HostBufferPoolClosed:
                if not closed_ok:
                    raise
        if buffer is not None:
            return buffer.tensor, buffer
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned), None

    def release(self, buffer: HostBuffer) -> None:
        """Return ``buffer``'s bytes to the pool and wake waiters. Allowed after ``close``.
        ValueError if the buffer is not this pool's or was released already."""
        with self._cond:
            if buffer._pool is not self or self._live.get(buffer.offset) is not buffer:
                raise ValueError(f"{buffer!r} is not outstanding in this pool (released "
                                 f"twice, or acquired from another pool)")
            del self._live[buffer.offset]
            size = self._reserved.pop(buffer.offset)
            self._in_use -= size
            self._give_back(buffer.offset, buffer.offset + size)
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse further acquires and wake waiters with ``HostBufferPoolClosed``. Buffers
        still out stay valid (their memory lives while a view of it does)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __enter__(self) -> HostBufferPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # internals (called with the lock held, except _size)
    def _size(self, nbytes: int) -> int:
        try:
            nbytes = operator.index(nbytes)
        except TypeError:
            raise TypeError(f"nbytes must be an integer, got {nbytes!r}") from None
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        if nbytes > self.capacity_bytes:
            raise ValueError(f"{nbytes} bytes can never fit a pool of {self.capacity_bytes}")
        align = self._config.alignment
        return min(-(-nbytes // align) * align, self.capacity_bytes)

    def _check_open(self) -> None:
        if self._closed:
            raise HostBufferPoolClosed("the host buffer pool is closed")

    def _take(self, size: int) -> int | None:
        for i, (start, end) in enumerate(zip(self._free_starts, self._free_ends)):
            if end - start >= size:
                if end - start == size:
                    del self._free_starts[i], self._free_ends[i]
                else:
                    self._free_starts[i] = start + size
                return start
        return None

    def _give_back(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        merge_left = i > 0 and self._free_ends[i - 1] == start
        merge_right = i < len(self._free_starts) and self._free_starts[i] == end
        if merge_left and merge_right:
            self._free_ends[i - 1] = self._free_ends[i]
            del self._free_starts[i], self._free_ends[i]
        elif merge_left:
            self._free_ends[i - 1] = end
        elif merge_right:
            self._free_starts[i] = start
        else:
            self._free_starts.insert(i, start)
            self._free_ends.insert(i, end)

    def _hand_out(self, offset: int, nbytes: int, size: int) -> HostBuffer:
        buffer = HostBuffer(self, self._slab[offset:offset + nbytes], offset)
        self._live[offset] = buffer
        self._reserved[offset] = size
        self._in_use += size
        return buffer
