"""glibc malloc settings for a worker process: keep freed handoff-sized buffers instead of
handing their pages back to the kernel.

Every handoff message is a few MiB of fresh memory on both ends (gRPC's receive slices and the
``bytes`` it joins them into, the encoded chunks a sender makes). glibc serves such sizes by
``mmap`` or from the heap's top, and gives them back (``munmap``, or a trim once 128 KiB are free
at the top) as soon as they are freed, so the next message faults every page in again and the
kernel zeroes it: on the 2-core machine the decode side's gRPC threads spent about half their
time in page faults and their memory-cgroup accounting. Raising the two thresholds keeps that
memory in the process for the next message. ``docs/protocol.md`` ("Transport rates") has the
rates before and after.

glibc reads the same settings from ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``;
calling ``mallopt`` sets them in a process already running. Elsewhere (another C library) this
does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# mallopt parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@dataclass(frozen=True)
class HostMallocConfig:
    """``mmap_threshold_bytes``: allocations below this come from the heap (glibc caps it at
    32 MiB on 64-bit machines); ``trim_threshold_bytes``: free memory at the heap's top kept
    before glibc gives it back. The process may hold that much freed memory beyond its live
    set."""

    mmap_threshold_bytes: int = 32 << 20
    trim_threshold_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not 0 < self.mmap_threshold_bytes <= 32 << 20:
            raise ValueError("mmap_threshold_bytes must be in (0, 32 MiB], got "
                             f"{self.mmap_threshold_bytes}")
        if self.trim_threshold_bytes < 0:
            raise ValueError(f"trim_threshold_bytes must be >= 0, got "
                             f"{self.trim_threshold_bytes}")


def tune_host_malloc(config: HostMallocConfig = HostMallocConfig()) -> bool:
    """Apply ``config`` to this process's glibc malloc; False (and a debug log line) where the
    C library is not glibc or refuses a setting."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("no mallopt in this C library (%s): malloc left as it is", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = (mallopt(_M_MMAP_THRESHOLD, config.mmap_threshold_bytes) == 1
            and mallopt(_M_TRIM_THRESHOLD, config.trim_threshold_bytes) == 1)
    if not done:
        log.debug("mallopt refused %s: malloc left as it is", config)
    return done
