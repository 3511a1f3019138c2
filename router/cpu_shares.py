"""How ``flashsplit up`` divides the host's CPUs between the CPU workers it starts.

A worker on the CPU computes with ``--cpu-threads`` threads (0: every CPU it may use). Workers
that each take every core wait for each other inside every op (``common/cpu_threads.py`` has
the measurement), so ``up`` gives each CPU worker that was not given ``--cpu-threads`` an even
share of what the others leave: a worker with ``--tp N`` counts as N ranks. Workers on a GPU
are left alone (their compute is on the device).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.memory_shares import devices_of


def _given_threads(args: Sequence[str]) -> int | None:
    """The worker's last ``--cpu-threads`` (None when not given)."""
    value = None
    for name, given in zip(args, args[1:]):
        if name == "--cpu-threads":
            value = int(given)
    return value


def cpu_thread_shares(worker_args: Sequence[Sequence[str]], cpus: int) -> list[int | None]:
    """Each worker's ``--cpu-threads`` to add (None: nothing to add): the ``cpus`` left after
    the workers given a count, split evenly between the ranks of the CPU workers that were
    not; at least one thread per rank."""
    on_cpu = [set(devices_of(args)) == {"cpu"} for args in worker_args]
    given = [_given_threads(args) for args in worker_args]
    taken = sum(g for g, cpu in zip(given, on_cpu) if cpu and g)
    ranks = [len(devices_of(args)) for args in worker_args]
    sharing = sum(r for r, g, cpu in zip(ranks, given, on_cpu) if cpu and g is None)
    if not sharing:
        return [None] * len(worker_args)
    per_rank = max(1, (cpus - taken) // sharing)
    return [per_rank * r if cpu and g is None else None
            for r, g, cpu in zip(ranks, given, on_cpu)]
