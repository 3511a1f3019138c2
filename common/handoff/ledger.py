"""Which bytes of a payload arrived, and their CRC-32C.

Chunks may arrive in any order and land on several threads at once, so a receiver claims each
chunk's byte range as the chunk arrives (overlaps are refused there, before any byte is
written), records its CRC once it has landed, and at the trailer folds the CRCs in (layer,
offset) order with ``crc32c_combine``. The result equals ``crc32c`` over the field's bytes in
order, which is what the sender computed, and the receiver never reads its destination memory
back (it may be on the GPU).

``message_payload_crc`` is how both ends checksum a chunk inside an encoded message: over its
payload, read in place with the GIL released (``common/handoff/checksum.py``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from common.handoff.checksum import crc32c, crc32c_combine
from common.handoff.errors import HandoffError
from common.handoff.manifest import FieldSpec


def message_payload_crc(message: bytes, payload_start: int) -> int:
    """``crc32c(message[payload_start:])``, read in place."""
    if not 0 <= payload_start <= len(message):
        raise ValueError(f"payload_start {payload_start} is outside a message of "
                         f"{len(message)} bytes")
    return crc32c(memoryview(message)[payload_start:])


@dataclass
class LayerLedger:
    """Byte ranges of one layer of one field, sorted by offset, each with its CRC-32C (None
    while the range is claimed and its bytes are still landing)."""

    nbytes: int
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    crcs: list[int | None] = field(default_factory=list)

    def claim(self, start: int, nbytes: int, where: str) -> None:
        """Take ``[start, start + nbytes)`` for a chunk about to land; INVALID_ARGUMENT if it
        overlaps a range claimed before."""
        end = start + nbytes
        i = bisect.bisect_left(self.starts, start)
        if (i > 0 and self.ends[i - 1] > start) or (i < len(self.starts) and self.starts[i] < end):
            raise HandoffError("INVALID_ARGUMENT",
                               f"{where}: bytes [{start}, {end}) overlap bytes received before")
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.crcs.insert(i, None)

    def record(self, start: int, crc: int) -> None:
        """The CRC-32C of the range claimed at ``start``, once its bytes have landed."""
        i = bisect.bisect_left(self.starts, start)
        if i == len(self.starts) or self.starts[i] != start:
            raise ValueError(f"no range was claimed at offset {start}")
        self.crcs[i] = crc

    def add(self, start: int, data, where: str) -> None:
        """Claim and record ``data`` at ``start`` in one go (bytes checksummed here)."""
        self.claim(start, len(data), where)
        self.record(start, crc32c(data))

    def fold(self, crc: int, where: str) -> int:
        """Extend ``crc`` with this layer's bytes; DATA_LOSS if any byte is missing."""
        pos = 0
        for start, end, piece in zip(self.starts, self.ends, self.crcs):
            if start != pos or piece is None:
                break
            crc = crc32c_combine(crc, piece, end - start)
            pos = end
        if pos != self.nbytes:
            raise HandoffError("DATA_LOSS", f"{where}: bytes missing from offset {pos} "
                               f"({self.nbytes} expected)")
        return crc


def new_ledgers(manifest: dict[str, FieldSpec]) -> dict[tuple[str, int], LayerLedger]:
    """An empty checksum ledger for every layer of every field of ``manifest``."""
    return {(name, layer): LayerLedger(spec.layer_nbytes)
            for name, spec in manifest.items() for layer in range(spec.num_layers)}


def fold_checksums(manifest: dict[str, FieldSpec],
                   ledgers: dict[tuple[str, int], LayerLedger]) -> dict[str, int]:
    """The CRC of each field of ``manifest`` over its layers' ledgers (a layer without one
    has no bytes): the sender's trailer, and what the receiver checks it against. DATA_LOSS
    if any byte is missing."""
    checksums = {}
    for name, spec in manifest.items():
        crc = 0
        for layer in range(spec.num_layers):
            ledger = ledgers.get((name, layer)) or LayerLedger(spec.layer_nbytes)
            crc = ledger.fold(crc, f"field {name!r} layer {layer}")
        checksums[name] = crc
    return checksums
