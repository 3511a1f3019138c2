"""The followers' copy of each running request's page list, so that a step's message carries a
page count per row instead of the pages themselves.

A request's pages are reserved whole when it is admitted (prompt and every new token:
``Scheduler.reserve``, or a handoff's room) and given back whole when it ends, and its
``page_ids`` list is never changed in between, only replaced. So rank 0 sends each request's
list once, the first time a step uses its state slot with that list, and afterwards only how
many of its pages the step reads. At 64 rows of 2,048 pages (32k tokens each) the pages alone
were 370 KiB to pickle and broadcast per step, 4 ms of pickling.

Rank 0 (:class:`LeaderTables`) compares lists by identity: it keeps a reference to each list it
sent, so a new request's list can never be mistaken for the one before it in the same slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PagedRows:
    """The pages of a step's rows: row r reads the first ``counts[r]`` pages of the list held
    for state slot ``slots[r]``; ``tables`` holds the lists new to the followers, by slot."""

    slots: list[int]
    counts: list[int]
    tables: dict[int, list[int]]


class LeaderTables:
    """Rank 0's record of the page list each follower holds per state slot."""

    def __init__(self) -> None:
        self._sent: dict[int, list[int]] = {}

    def rows(self, slots: Sequence[int], tables: Sequence[list[int]],
             pages: Sequence[Sequence[int]]) -> PagedRows:
        """The :class:`PagedRows` of rows whose state ``slots`` hold requests with page lists
        ``tables`` (the requests' own lists), of which a step reads ``pages`` (a prefix of each).

        Raises ValueError when a row's pages are not its list's first pages."""
        new: dict[int, list[int]] = {}
        counts = []
        for slot, table, used in zip(slots, tables, pages, strict=True):
            n = len(used)
            if n and (n > len(table) or table[n - 1] != used[-1] or table[0] != used[0]):
                raise ValueError(f"slot {slot}: the step's {n} pages are not the first pages "
                                 f"of its request's {len(table)}")
            if self._sent.get(slot) is not table:
                self._sent[slot] = new[int(slot)] = table
            counts.append(n)
        return PagedRows([int(s) for s in slots], counts, new)


class FollowerTables:
    """A follower's page list per state slot, as rank 0 last sent it."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def clear(self) -> None:
        self._tables.clear()

    def pages(self, rows: PagedRows) -> list[list[int]]:
        """Each row's pages, after taking the lists ``rows`` brings."""
        self._tables.update(rows.tables)
        try:
            return [self._tables[s][:n] for s, n in zip(rows.slots, rows.counts)]
        except KeyError as exc:
            raise RuntimeError(f"rank 0 never sent the page list of slot {exc.args[0]}") from None
