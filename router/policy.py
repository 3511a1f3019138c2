"""Worker choice: pure functions from a snapshot of the worker table to an address.

Prefill is chosen by queue length, decode by free capacity. Both see only ``WorkerView``s, a
frozen snapshot taken under no lock, so a choice never changes the table it was made from and the
functions can be tested without a registry, a clock or a network.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerView:
    """What worker choice needs to know about one worker.

    queue_len, free_slots and free_pages come from the worker's last load report; in_flight is the
    router's own count of requests assigned to it that the report cannot show yet (for prefill:
    calls not yet answered; for decode: handoffs not yet acknowledged).
    """

    address: str
    kind: str
    healthy: bool
    fingerprint: str = ""
    queue_len: int = 0
    free_slots: int = 0
    free_pages: int = 0
    in_flight: int = 0


def prefill_score(w: WorkerView) -> int:
    """Work ahead of a new prompt on this worker; lower is better."""
    return w.queue_len + w.in_flight


def decode_score(w: WorkerView) -> tuple[int, int]:
    """Room for one more request, free slots first, then free pages; higher is better.

    Each in-flight handoff will take one slot and at least one page once it lands, so both are
    discounted by it.
    """
    return (w.free_slots - w.in_flight, w.free_pages - w.in_flight)


def _eligible(workers: Sequence[WorkerView], kind: str,
              exclude: Collection[str]) -> list[WorkerView]:
    return [w for w in workers if w.kind == kind and w.healthy and w.address not in exclude]


def choose_prefill(workers: Sequence[WorkerView], *, exclude: Collection[str] = (),
                   turn: int = 0) -> WorkerView | None:
    """The healthy prefill worker with the shortest queue, or None when there is none.

    Ties are broken round-robin: the tied workers in address order, the ``turn``-th of them
    (modulo their number). Callers pass an increasing counter so that equally idle workers take
    turns instead of the first address taking every request between two load reports.
    """
    candidates = _eligible(workers, "prefill", exclude)
    if not candidates:
        return None
    best = min(prefill_score(w) for w in candidates)
    tied = sorted((w for w in candidates if prefill_score(w) == best), key=lambda w: w.address)
    return tied[turn % len(tied)]


def choose_decode(workers: Sequence[WorkerView], *, exclude: Collection[str] = (),
                  fingerprint: str = "", turn: int = 0) -> WorkerView | None:
    """The healthy decode worker with the most room, or None when there is none.

    When ``fingerprint`` is given, only workers serving that model qualify (a handoff between
    different models is refused anyway; workers that have not reported one yet are not ruled out).
    A worker with no room left is still chosen when it is the best there is: its report may be
    stale, and a refusal is retried elsewhere. Ties are broken round-robin as in
    ``choose_prefill``.
    """
    candidates = [w for w in _eligible(workers, "decode", exclude)
                  if not fingerprint or not w.fingerprint or w.fingerprint == fingerprint]
    if not candidates:
        return None
    best = max(decode_score(w) for w in candidates)
    tied = sorted((w for w in candidates if decode_score(w) == best), key=lambda w: w.address)
    return tied[turn % len(tied)]


def choose_pair(workers: Sequence[WorkerView], *, exclude: Collection[str] = (),
                turn: int = 0) -> tuple[WorkerView, WorkerView] | None:
    """A (prefill, decode) pair serving the same model, or None when no such pair is healthy.

    The prefill worker is chosen first (queueing is the larger share of time to first token),
    then the best decode worker for its model. When that prefill worker has no compatible decode
    worker, the next-best prefill worker is tried.
    """
    excluded = set(exclude)
    while True:
        prefill = choose_prefill(workers, exclude=excluded, turn=turn)
        if prefill is None:
            return None
        decode = choose_decode(workers, exclude=excluded, fingerprint=prefill.fingerprint,
                               turn=turn)
        if decode is not None:
            return prefill, decode
        excluded.add(prefill.address)
