"""How ``flashsplit up`` divides the host's CPUs between the CPU workers it starts.

A worker on the CPU computes with ``--cpu-threads`` threads (0: every CPU it may use). Workers
that each take every core wait for each other inside every op (``common/cpu_threads.py`` has
the measurement), so ``up`` gives each CPU worker that was not given ``--cpu-threads`` an even
share of what the others leave: a worker with ``--tp N`` counts as N ranks. Workers on a GPU
are left alone (their compute is on the device).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.memory_shares import devices_of, last_flag


def cpu_thread_shares(worker_args: Sequence[Sequence[str]], cpus: int) -> list[int | None]:
    """Each worker's ``--cpu-threads`` to add (None: nothing to add): the ``cpus`` left after
    the workers given a count, split evenly between the ranks of the CPU workers that were
    not; at least one thread per rank."""
    # per worker: its ranks on the CPU (0 when on a GPU), and the count it was given
    ranks = [len(d) if set(d) == {"cpu"} else 0 for d in map(devices_of, worker_args)]
    given = [last_flag(args, "--cpu-threads", None) for args in worker_args]
    taken = sum(int(g) for g, r in zip(given, ranks) if r and g is not None)
    sharing = sum(r for r, g in zip(ranks, given) if g is None)
    if not sharing:
        return [None] * len(worker_args)
    per_rank = max(1, (cpus - taken) // sharing)
    return [per_rank * r if r and g is None else None for r, g in zip(ranks, given)]
