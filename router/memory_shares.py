"""How ``flashsplit up --mem-fraction F`` divides memory between the workers it starts.

Each worker's ``--mem-fraction`` is a fraction of its own device's total memory
(``common/cache/sizing.py``), so workers that share a device must add up to at most the whole.
``up`` gives the workers of one device equal shares of F: one prefill and one decode worker on
``--device cuda`` get F/2 each, and on the CPU every worker shares the host's memory.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

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


def device_of(args: Sequence[str]) -> str:
    """The device a worker started with ``args`` runs on (its last ``--device``)."""
    device = DEFAULT_DEVICE
    for flag, value in zip(args, args[1:]):
        if flag == "--device":
            device = value
    return device_key(device)


def memory_shares(worker_args: Sequence[Sequence[str]], fraction: float) -> list[float]:
    """Each worker's ``--mem-fraction``: ``fraction`` split evenly between the workers of one
    device. ValueError for a fraction outside (0, 1]."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {fraction}")
    devices = [device_of(args) for args in worker_args]
    per_device = Counter(devices)
    # rounded down (to what a command line carries), so that the shares never add up to more
    return [math.floor(fraction / per_device[d] * 1e6) / 1e6 for d in devices]
