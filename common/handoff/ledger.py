"""Which bytes of a payload arrived, and their CRC-32.

Chunks may arrive in any order, so the receiver keeps one CRC per chunk and, at the trailer,
folds them in (layer, offset) order with ``crc32_combine``. The result equals ``zlib.crc32`` over
the field's bytes in order, which is what the sender computed, and the receiver never reads its
destination memory back (it may be on the GPU).
"""

from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass, field

from common.handoff.errors import HandoffError

_POLY = 0xEDB88320  # reflected CRC-32 polynomial of zlib
# _ZEROS_OPS[k]: the GF(2) operator (32 column words) that advances a CRC over 2**k zero bytes.
_ZEROS_OPS: list[list[int]] = []


def _times(op: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= op[i]
        vec >>= 1
        i += 1
    return out


def _square(op: list[int]) -> list[int]:
    return [_times(op, col) for col in op]


def _zeros_op(k: int) -> list[int]:
    if not _ZEROS_OPS:
        op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):                           # -> 2, 4, 8 bits = one byte
            op = _square(op)
        _ZEROS_OPS.append(op)
    while len(_ZEROS_OPS) <= k:
        _ZEROS_OPS.append(_square(_ZEROS_OPS[-1]))
    return _ZEROS_OPS[k]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len2 = len(b)``
    (zlib's own crc32_combine, which Python's zlib does not expose)."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_zeros_op(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


@dataclass
class LayerLedger:
    """Byte ranges received for one layer of one field, sorted by offset, each with its CRC."""

    nbytes: int
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)

    def add(self, start: int, data: bytes, where: str) -> None:
        """Record ``data`` at ``start``; INVALID_ARGUMENT if it overlaps bytes received before."""
        end = start + len(data)
        i = bisect.bisect_left(self.starts, start)
        if (i > 0 and self.ends[i - 1] > start) or (i < len(self.starts) and self.starts[i] < end):
            raise HandoffError("INVALID_ARGUMENT",
                               f"{where}: bytes [{start}, {end}) overlap bytes received before")
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.crcs.insert(i, zlib.crc32(data))

    def fold(self, crc: int, where: str) -> int:
        """Extend ``crc`` with this layer's bytes; DATA_LOSS if any byte is missing."""
        pos = 0
        for start, end, piece in zip(self.starts, self.ends, self.crcs):
            if start != pos:
                break
            crc = crc32_combine(crc, piece, end - start)
            pos = end
        if pos != self.nbytes:
            raise HandoffError("DATA_LOSS", f"{where}: bytes missing from offset {pos} "
                               f"({self.nbytes} expected)")
        return crc
