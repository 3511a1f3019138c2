"""Where a receiver puts the bytes of a handoff: the interface, and an in-memory implementation.

The decode worker implements ``Reservation`` over its pools (KV pages and a GDN state slot held
for the request, ``decode_service/reservation.py``), so chunk bytes land in place with no
intermediate payload copy.

A chunk's bytes come as a buffer (``bytes`` or a memoryview: a message from the gRPC stream) or
as a uint8 CPU tensor (a reusable host buffer that a ``tcp`` frame was read into; pinned on a
GPU worker, so the copy to the device is a true asynchronous one). ``write`` returns once its
source may be reused: from a pageable buffer CUDA has staged the bytes by then, from a tensor
the writer waits for its copy (``PoolReservation.write``).
"""

from __future__ import annotations

import warnings
from typing import Protocol, Union

import numpy as np
import torch

from common.handoff.layout import to_dtype
from common.handoff.manifest import FieldSpec

# a chunk's bytes as a reservation takes them: a received buffer, or a (pinned) host tensor
ChunkBytes = Union[bytes, memoryview, torch.Tensor]


class Reservation(Protocol):
    """Room held for one handoff, from its header until it is committed or released.

    Invariants: the assembler calls ``write`` only with byte ranges it has checked (inside one
    layer of a declared field, never overlapping an earlier write), then exactly one of
    ``commit`` (every byte arrived and every checksum matched; ownership passes to the caller) or
    ``release`` (any failure or abort). ``write`` may be called from threads other than the one
    that reserved, several at once for disjoint ranges; ``release`` waits for writes running.
    """

    def write(self, field: str, layer: int, offset: int, data: ChunkBytes) -> None:
        """Land ``data`` at byte ``offset`` of index ``layer`` along dim 0 of ``field`` (whose
        bytes are laid out as the manifest's shape, C order). Returns once ``data`` may be
        reused or freed (its bytes are in place, or a copy no longer reads them)."""
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


def write_bytes(tensor: torch.Tensor, offset: int, data: ChunkBytes) -> None:
    """Copy ``data`` into the contiguous ``tensor``'s bytes at ``offset`` (any device). On a
    GPU the copy is queued on the current stream (``non_blocking``): from a pinned tensor it
    still reads ``data`` after this returns."""
    src = host_bytes(data) if isinstance(data, torch.Tensor) else data
    nbytes = src.numel() if isinstance(src, torch.Tensor) else len(src)
    flat = tensor.reshape(-1).view(torch.uint8)[offset:offset + nbytes]
    if flat.device.type == "cpu":
        flat.numpy()[:] = (src.numpy() if isinstance(src, torch.Tensor)
                           else np.frombuffer(src, dtype=np.uint8))
    else:
        flat.copy_(host_bytes(src), non_blocking=True)


def host_bytes(data: ChunkBytes) -> torch.Tensor:
    """A 1-D uint8 CPU tensor over ``data`` without copying (it is only ever read). A tensor
    (a host buffer's, maybe pinned) is returned as it is, so torch still knows it is pinned;
    TypeError for one that is not a 1-D uint8 CPU tensor."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(f"chunk bytes as a tensor must be 1-D uint8 on the CPU, got "
                            f"{data.dtype}{list(data.shape)} on {data.device}")
        return data
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

    def write(self, field: str, layer: int, offset: int, data: ChunkBytes) -> None:
        target = self.tensors[field][layer]
        write_bytes(target, offset, data)
        if isinstance(data, torch.Tensor) and target.device.type == "cuda":
            # a copy from pinned memory is still reading it: the caller may reuse it next
            torch.cuda.current_stream(target.device).synchronize()

    def commit(self) -> None:
        self.num_commits += 1

    def release(self) -> None:
        self.num_releases += 1
        self.tensors = {}
