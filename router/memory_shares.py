"""How ``flashsplit up --mem-fraction F`` divides memory between the workers it starts.

Each worker's ``--mem-fraction`` is a fraction of its own device's total memory
(``common/cache/sizing.py``), so workers that share a device must add up to at most the whole.
``up`` gives the workers of one device equal shares of F: one prefill and one decode worker on
``--device cuda`` get F/2 each, and on the CPU every worker shares the host's memory. A worker
with ``--tp N`` is on each of its ranks' devices (``common.parallel.launch.rank_devices``), and
its share is the one of its most crowded device: every rank of it takes the same fraction of
its own device. On the CPU its N ranks together take the worker's share.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from common.parallel.placement import rank_devices

DEFAULT_DEVICE = "cpu"  # a worker's --device when none is given


def device_key(device: str) -> str:
    """Names one device one way: ``cuda`` is ``cuda:0`` (the first visible GPU), and every
    ``cpu`` is the host."""
    device = device.strip().lower()
    if device == "cuda":
        return "cuda:0"
    if device.startswith("cpu"):
        return "cpu"
    return device


def last_flag(args: Sequence[str], flag: str, default: str | None) -> str | None:
    """The value of the last ``flag`` in a command line, or ``default`` when it has none."""
    value = default
    for name, given in zip(args, args[1:]):
        if name == flag:
            value = given
    return value


def device_of(args: Sequence[str]) -> str:
    """The device a worker started with ``args`` runs on (its last ``--device``); rank 0's for
    a worker with ``--tp``."""
    return devices_of(args)[0]


def devices_of(args: Sequence[str]) -> list[str]:
    """The devices of a worker's ranks, one per rank of its last ``--tp`` (1 without), from
    its last ``--device``."""
    tp = int(last_flag(args, "--tp", "1"))
    device = last_flag(args, "--device", DEFAULT_DEVICE).strip().lower()
    if device.startswith("cpu"):
        device = "cpu"
    return [device_key(d) for d in rank_devices(device, tp)]


def memory_shares(worker_args: Sequence[Sequence[str]], fraction: float) -> list[float]:
    """Each worker's ``--mem-fraction``: ``fraction`` split evenly between the workers of one
    device. ValueError for a fraction outside (0, 1]."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {fraction}")
    devices = [set(devices_of(args)) for args in worker_args]
    per_device = Counter(d for ds in devices for d in ds)
    # rounded down (to what a command line carries), so that the shares never add up to more
    return [math.floor(fraction / max(per_device[d] for d in ds) * 1e6) / 1e6
            for ds in devices]
