"""Free lists for KV pages and GDN state slots (pure Python, no tensors).

Index 0 of every pool is scratch: padded rows of a batch point at it, so it is never handed out.
"""

from __future__ import annotations

import threading


class OutOfResources(RuntimeError):
    """A pool cannot satisfy an allocation; the caller should refuse or wait, not crash."""


class IndexAllocator:
    """Hands out indices 1..capacity-1 of a pool and takes them back.

    Every index has at most one owner; freeing an index that is not allocated is an error, so a
    double free shows up at once instead of corrupting a neighbour's cache. Thread-safe: a decode
    worker reserves room for an arriving handoff while its engine thread frees finished requests.
    """

    def __init__(self, capacity: int, *, name: str) -> None:
        if capacity < 2:
            raise ValueError(f"{name} pool needs at least 2 entries (entry 0 is scratch)")
        self.name = name
        self.capacity = capacity
        # LIFO keeps recently freed (cache-warm) entries in use first.
        self._free = list(range(capacity - 1, 0, -1))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.capacity - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("cannot allocate a negative count")
        with self._lock:
            if n > len(self._free):
                raise OutOfResources(f"{self.name}: asked for {n}, {len(self._free)} free")
            out = [self._free.pop() for _ in range(n)]
            self._used.update(out)
            return out

    def free(self, indices: list[int]) -> None:
        with self._lock:
            for i in indices:
                if i not in self._used:
                    raise ValueError(f"{self.name}: index {i} is not allocated")
            for i in indices:
                self._used.remove(i)
            # reversed, so the next allocation pops them in their order: a request's pages
            # then come in runs of consecutive ids, which a host copy lands as one slice each
            self._free.extend(reversed(indices))
