"""Where a receiver puts the bytes of a handoff: the interface, and an in-memory implementation.

The decode worker implements ``Reservation`` over its pools (KV pages and a GDN state slot held
for the request), so chunk bytes land in place with no intermediate payload copy.
"""

from __future__ import annotations

from typing import Protocol

import torch

from common.handoff.layout import to_dtype
from common.handoff.manifest import FieldSpec


class Reservation(Protocol):
    """Room held for one handoff, from its header until it is committed or released.

    Invariants: the assembler calls ``destination`` at most once per (field, layer), writes only
    inside what it returned, then calls exactly one of ``commit`` (every byte arrived and every
    checksum matched; ownership passes to the caller) or ``release`` (any failure or abort).
    """

    def destination(self, field: str, layer: int) -> torch.Tensor:
        """A writable, contiguous tensor (any dtype and device) whose bytes are exactly those of
        index ``layer`` along dim 0 of ``field``: ``FieldSpec.layer_nbytes`` of them."""
        ...

    def commit(self) -> None:
        """All bytes are in place and verified; finish (e.g. scatter staged pages into pools)."""
        ...

    def release(self) -> None:
        """Give back everything held; the handoff failed or was aborted."""
        ...


class InMemoryReservation:
    """Allocates one tensor per manifest field; for tests and same-process handoffs.

    ``num_commits`` and ``num_releases`` count the calls so tests can check release-exactly-once.
    """

    def __init__(self, manifest: dict[str, FieldSpec], device: torch.device | str = "cpu") -> None:
        self.tensors = {name: torch.empty(spec.shape, dtype=to_dtype(spec.dtype), device=device)
                        for name, spec in manifest.items()}
        self.num_commits = 0
        self.num_releases = 0

    def destination(self, field: str, layer: int) -> torch.Tensor:
        return self.tensors[field][layer]

    def commit(self) -> None:
        self.num_commits += 1

    def release(self) -> None:
        self.num_releases += 1
        self.tensors = {}
