"""What the ``device`` transport's ``PoolCopyPart``s of one handoff covered, and its checks.

A field arrives either as bytes (chunks, checked by ``LayerLedger`` and a checksum) or as pool
copies, never both. Paged fields (``kv``, ``dflash_context``) are covered page range by page
range, in any order, without overlap; a state field (``conv_state``, ``ssm_state``) by one copy
of its slot. No checksum guards a copy: the bytes never leave device memory (or the host's
shared memory), and a copy either runs or fails.
"""

from __future__ import annotations

import bisect

from common.handoff.errors import HandoffError
from common.handoff.parts import PoolCopyPart

PAGED_FIELDS = ("kv", "dflash_context")
STATE_FIELDS = ("conv_state", "ssm_state")


class PoolCopyLedger:
    """Page ranges received per field; ``num_pages`` is the prompt's page count."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._ranges: dict[str, list[tuple[int, int]]] = {}

    @property
    def fields(self) -> set[str]:
        return set(self._ranges)

    def add(self, part: PoolCopyPart, declared: set[str]) -> None:
        """Record ``part``; INVALID_ARGUMENT for an undeclared or unpaged field, an empty or
        out-of-range copy, or one overlapping an earlier copy."""
        where = f"pool copy of field {part.field!r}"
        if part.field not in declared:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: field not declared in the manifest")
        if part.field in PAGED_FIELDS:
            start, end = part.dst_start, part.dst_start + len(part.src_index)
            if not part.src_index or start < 0 or end > self.num_pages:
                raise HandoffError("INVALID_ARGUMENT", f"{where}: pages [{start}, {end}) are "
                                   f"empty or outside the prompt's {self.num_pages}")
        elif part.field in STATE_FIELDS:
            if len(part.src_index) != 1 or part.dst_start != 0:
                raise HandoffError("INVALID_ARGUMENT", f"{where}: a state field is copied from "
                                   "exactly one slot")
            start, end = 0, 1
        else:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: only pool fields can be copied")
        ranges = self._ranges.setdefault(part.field, [])
        i = bisect.bisect_left(ranges, (start, end))
        if (i > 0 and ranges[i - 1][1] > start) or (i < len(ranges) and ranges[i][0] < end):
            raise HandoffError("INVALID_ARGUMENT",
                               f"{where}: [{start}, {end}) overlaps a copy received before")
        ranges.insert(i, (start, end))

    def check_complete(self, field: str) -> None:
        """DATA_LOSS unless ``field`` was copied whole."""
        want = self.num_pages if field in PAGED_FIELDS else 1
        have = sum(end - start for start, end in self._ranges.get(field, []))
        if have != want:
            raise HandoffError("DATA_LOSS", f"field {field!r}: {have} of {want} pages copied")
