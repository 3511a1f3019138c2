"""How many CPU threads a worker computes with, and how workers on one host share the cores.

Torch (OpenMP) starts one thread per core it sees, and each thread of a parallel region spins
for a while at the region's end waiting for the others. Two workers on one host that each take
every core run twice as many threads as there are cores: a region finishes only when its last
thread is scheduled again, so each worker's ops wait for the other's. Measured on a 2-core
host (tiny model, one prefill and one decode worker, 16 prompts of 64 tokens at once, 128 new
tokens each): the median time to the first token was 535-970 ms with two threads per worker
and 100-170 ms with one, the wall time 1.9-2.5 s against 1.3-1.6 s. So ``flashsplit up``
gives the CPU workers it starts an even share of the host (``--cpu-threads``,
``router/cpu_shares.py``), as vLLM's and SGLang's CPU backends give each instance its own
cores.

Torch's own count is the process's CPU affinity; a container's CPU limit (a cgroup quota) is
not in it, so a worker limited to 4 CPUs on a 64-core node would run 64 threads. The count
here takes the quota into account.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# cgroup v2 names the quota in one file, v1 in two
_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
              Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cgroup_cpu_limit(v2: Path = _CGROUP_V2, v1: tuple[Path, Path] = _CGROUP_V1) -> int | None:
    """The CPUs a cgroup quota allows this process (rounded up), or None without a quota."""
    try:
        quota, period = v2.read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = (path.read_text().strip() for path in v1)
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None


def available_cpus() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup CPU quota; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cpus, limit) if limit is not None else cpus)


def worker_cpu_threads(asked: int) -> int:
    """A worker's threads for ``--cpu-threads asked``: ``asked``, or every CPU it may use when
    0. ValueError for a negative count."""
    if asked < 0:
        raise ValueError(f"--cpu-threads must be >= 0 (0: every CPU this worker may use), "
                         f"got {asked}")
    return asked or available_cpus()
