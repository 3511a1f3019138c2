"""Where a receiver puts the bytes of a handoff: the interface, and an in-memory implementation.

The decode worker implements ``Reservation`` over its pools (KV pages and a GDN state slot held
for the request, ``decode_service/reservation.py``), so chunk bytes land in place with no
intermediate payload copy.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import numpy as np
import torch

from common.handoff.layout import to_dtype
from common.handoff.manifest import FieldSpec


class Reservation(Protocol):
    """Room held for one handoff, from its header until it is committed or released.

    Invariants: the assembler calls ``write`` only with byte ranges it has checked (inside one
    layer of a declared field, never overlapping an earlier write), then exactly one of
    ``commit`` (every byte arrived and every checksum matched; ownership passes to the caller) or
    ``release`` (any failure or abort). ``write`` may be called from threads other than the one
    that reserved, several at once for disjoint ranges; ``release`` waits for writes running.
    """

    def write(self, field: str, layer: int, offset: int, data: bytes | memoryview) -> None:
        """Land ``data`` at byte ``offset`` of index ``layer`` along dim 0 of ``field`` (whose
        bytes are laid out as the manifest's shape, C order)."""
        ...

    def commit(self) -> None:
        """All bytes are in place and verified; finish (e.g. order later reads after the
        copies)."""
        ...

    # A reservation that accepted the ``device`` transport also has
    # ``copy_from(part: PoolCopyPart)``: run that copy out of the sender's pools.

    def release(self) -> None:
        """Give back everything held; the handoff failed or was aborted."""
        ...


def write_bytes(tensor: torch.Tensor, offset: int, data: bytes | memoryview) -> None:
    """Copy ``data`` into the contiguous ``tensor``'s bytes at ``offset`` (any device)."""
    flat = tensor.reshape(-1).view(torch.uint8)[offset:offset + len(data)]
    if flat.device.type == "cpu":
        flat.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    else:
        flat.copy_(host_bytes(data), non_blocking=True)


def host_bytes(data: bytes | memoryview) -> torch.Tensor:
    """A uint8 CPU tensor over ``data`` without copying (it is only ever read)."""
    with warnings.catch_warnings():
        # torch warns that a read-only buffer is not writable; nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class InMemoryReservation:
    """Allocates one tensor per manifest field; for tests and same-process handoffs.

    ``num_commits`` and ``num_releases`` count the calls so tests can check release-exactly-once.
    """

    def __init__(self, manifest: dict[str, FieldSpec], device: torch.device | str = "cpu") -> None:
        self.tensors = {name: torch.empty(spec.shape, dtype=to_dtype(spec.dtype), device=device)
                        for name, spec in manifest.items()}
        self.num_commits = 0
        self.num_releases = 0

    def write(self, field: str, layer: int, offset: int, data: bytes | memoryview) -> None:
        write_bytes(self.tensors[field][layer], offset, data)

    def commit(self) -> None:
        self.num_commits += 1

    def release(self) -> None:
        self.num_releases += 1
        self.tensors = {}
