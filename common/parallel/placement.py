"""Where the ranks of a tensor-parallel group run: a device each, and on the CPU their share of
the threads. Imports no torch, so ``flashsplit up`` plans its workers without it."""

from __future__ import annotations

from common.cpu_threads import worker_cpu_threads


def rank_devices(device: str, world_size: int) -> list[str]:
    """One device per rank: ``cpu`` for all of them, or ``cuda:k+r`` from ``cuda`` /
    ``cuda:k`` (consecutive GPUs), or a comma-separated list of one device per rank."""
    devices = [d.strip() for d in device.split(",") if d.strip()]
    if len(devices) > 1:
        if len(devices) != world_size:
            raise ValueError(f"{len(devices)} devices given for {world_size} ranks")
        return devices
    (one,) = devices or ["cpu"]
    if one == "cpu":
        return ["cpu"] * world_size
    if one.startswith("cuda"):
        first = int(one.split(":", 1)[1]) if ":" in one else 0
        return [f"cuda:{first + r}" for r in range(world_size)]
    raise ValueError(f"device {one!r} is neither cpu nor cuda[:N]")


def cpu_threads_per_rank(world_size: int, cpu_threads: int = 0) -> int:
    """Threads each rank of a CPU group uses: ``cpu_threads`` (0: every CPU this process may
    use, ``common.cpu_threads.available_cpus``) shared evenly."""
    return max(1, worker_cpu_threads(cpu_threads) // world_size)
