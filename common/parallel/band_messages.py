"""Per-rank handoff streams between rank 0 and its followers: the messages rank 0 broadcasts
about them, the store keys the followers report under, and the interface of the handler a
follower runs them with.

The broadcasts keep their order with the forwards (rank 0 sends them from its engine thread,
between steps), which is what makes the pages safe: a follower hears that a handoff's pages
were freed before it runs any forward that reuses them. The bytes and the reports do not go
through the collectives: a follower's band sender and receiver run on threads of their own,
and what they report (a listener's port, "ready", what was sent, what landed) is set in the
store under a key rank 0 waits for from a thread of its own, out of step with the group.

Prefill: :class:`SendBands` (a step made pages, or the GDN state, final: send this rank's
bands of them; after the final one, report what was sent) and :class:`DropBands` (the
request ended, however it did). Decode: :class:`OpenBandListener` (at start-up),
:class:`ExpectBands` (room was reserved: take this ticket's frames into these pages),
:class:`CompleteBands` (the trailer came: report what landed once this many frames did) and
:class:`ForgetBands` (the room is given back).

The handlers live with the services that own the senders and receivers
(``prefill_service/follower_bands.py``, ``decode_service/follower_bands.py``); a worker's
``__main__`` hands its handler's class to the group it starts, so nothing here imports them.

Only the per-rank port keys outlive a handoff: every other key is read and deleted by rank 0,
or deleted by the follower that set it when the handoff ends without rank 0 reading it
(:class:`DropBands`, :class:`ForgetBands`), so a worker's store does not grow with the
handoffs it serves.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.parallel.rank_streams import RankStreamPlan

PREFIX = "bands/"
POLL_FIRST_S, POLL_MAX_S = 0.0005, 0.01  # wait_for's polling interval, first and longest


@dataclass(frozen=True)
class SendBands:
    handoff_id: int
    plan: RankStreamPlan
    page_ids: list[int]  # the prompt's pages ``start`` on that the step made final
    start: int
    slot: int | None  # the GDN state is final too (the prompt's last chunk)


@dataclass(frozen=True)
class DropBands:
    handoff_id: int


@dataclass(frozen=True)
class OpenBandListener:
    host: str
    token: str | None  # what the listener's hello must carry (None: a cluster without one)


@dataclass(frozen=True)
class ExpectBands:
    ticket: bytes
    page_ids: list[int]
    slot: int
    prompt_len: int
    page_size: int
    src_tp: int


@dataclass(frozen=True)
class CompleteBands:
    ticket: bytes
    frames: tuple[int, ...]  # per decode rank, from the trailer
    idle_timeout_s: float


@dataclass(frozen=True)
class ForgetBands:
    ticket: bytes


BAND_MESSAGES = (SendBands, DropBands, OpenBandListener, ExpectBands, CompleteBands,
                 ForgetBands)


class BandHandler(Protocol):
    """What a follower runs band messages with (made once, by the follower, from a
    :data:`BandHandlerFactory`)."""

    def handle(self, message) -> None:
        """Act on one of :data:`BAND_MESSAGES`; TypeError for one this side does not take."""

    def close(self) -> None:
        """The follower stops: end the sender's or receiver's threads and sockets."""


# ``factory(tp, follower)``: called in the follower's process with its group and itself (its
# model and pools, once loaded); passed to a spawned process, so a top-level class or function
BandHandlerFactory = Callable[[object, object], BandHandler]


def port_key(rank: int) -> str:
    return f"{PREFIX}port/{rank}"


def ready_key(ticket: bytes, rank: int) -> str:
    return f"{PREFIX}ready/{ticket.hex()}/{rank}"


def landed_key(ticket: bytes, rank: int) -> str:
    return f"{PREFIX}landed/{ticket.hex()}/{rank}"


def sent_key(handoff_id: int, rank: int) -> str:
    return f"{PREFIX}sent/{handoff_id:016x}/{rank}"


def wait_for(store, keys: list[str], timeout_s: float) -> None:
    """Block until every key of ``keys`` is set; TimeoutError after ``timeout_s``.

    Polls with ``check`` rather than calling the store's own ``wait``: a TCPStore client
    holds its one connection for the whole of a ``wait``, so every other handoff's wait or
    report on this process would stand behind the slowest one. The interval grows from
    ``POLL_FIRST_S`` to ``POLL_MAX_S``: a report that is already there costs one round trip,
    a long landing a poll every few milliseconds."""
    deadline = time.monotonic() + timeout_s
    interval = POLL_FIRST_S
    while keys and not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no report under {keys} in {timeout_s} s")
        time.sleep(min(interval, left))
        interval = min(interval * 2, POLL_MAX_S)


def take_reports(store, keys: list[str], timeout_s: float) -> list:
    """The objects set under ``keys`` (blocking, on a thread of the caller's: never the
    engine thread nor an event loop), deleted once read; TimeoutError after ``timeout_s``
    (then none is deleted: the followers that set theirs delete them when the handoff
    ends)."""
    wait_for(store, keys, timeout_s)
    out = [pickle.loads(store.get(key)) for key in keys]
    for key in keys:
        store.delete_key(key)
    return out


class DueReports:
    """The reports a follower owes rank 0 under store keys. A key may be set only while its
    report is due (``expect`` made it so, no ``cancel`` since), so a report that finishes after
    its handoff ended sets nothing; ``cancel`` deletes whatever rank 0 did not read. Together
    they keep a handoff's keys out of the store once it ends, however it ends."""

    def __init__(self, store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._due: set[str] = set()

    def expect(self, key: str) -> None:
        with self._lock:
            self._due.add(key)

    def report(self, key: str, value) -> None:
        """Set ``key`` to ``value`` pickled, if its report is still due."""
        with self._lock:
            if key not in self._due:
                return  # its handoff ended while it was made: nobody will read it
            self._due.discard(key)
            self._store.set(key, pickle.dumps(value))

    def cancel(self, *keys: str) -> None:
        """The handoff ended: none of ``keys`` is due any more, and none stays set."""
        with self._lock:
            for key in keys:
                self._due.discard(key)
                self._store.delete_key(key)
