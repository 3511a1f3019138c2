"""CRC-32C of handoff bytes, and folding per-chunk CRCs of any reflected 32-bit CRC.

``crc32c`` runs the ``crc32c`` package (ICRAR's C extension): it uses the CPU's CRC32
instructions (SSE4.2 on x86-64, the CRC extension on Arm; a C slicing-by-8 table elsewhere),
reads any C-contiguous buffer in place, and releases the GIL while it reads one of more than
32 KiB. So a sender or landing thread checksums pinned host memory or a received buffer
directly, and the engine thread and the event loop run meanwhile. (``google-crc32c``, used
before, releases the GIL for ``bytes`` only, which cost every chunk a copy into ``bytes``.)

``crc32c_combine`` gives the CRC of a concatenation from the CRCs of its parts, so a receiver
that gets chunks in any order keeps one CRC per chunk and folds them at the trailer without
reading its destination back. ``Crc32Polynomial`` is that fold for any reflected 32-bit CRC:
``CRC32C`` (Castagnoli, 0x82F63B78) and ``CRC32`` (zlib's, 0xEDB88320, equal to
``common.handoff.ledger.crc32_combine``).

If the extension cannot be imported, ``crc32c`` raises ``Crc32cUnavailableError``;
``fast_crc32c_available()`` tells a worker at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

try:
    import crc32c as _crc32c
except ImportError:
    _crc32c = None

_MASK = 0xFFFFFFFF
# Lengths up to 2**61 bytes: x^(8 * len) needs x^(2^k) for k < 64.
_X2N_ENTRIES = 64


class Crc32cUnavailableError(RuntimeError):
    """The ``crc32c`` package's C extension could not be imported."""


def fast_crc32c_available() -> bool:
    """Whether ``crc32c`` can run (the ``crc32c`` package imported)."""
    return _crc32c is not None


def hardware_crc32c() -> bool:
    """Whether the checksum runs on the CPU's CRC instructions (else a C table, ~1 GB/s)."""
    return _crc32c is not None and bool(_crc32c.hardware_based)


def _contiguous_bytes(data):
    """``data``'s bytes as a buffer the extension reads in place (no copy)."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"crc32c needs host memory, got a tensor on {data.device}")
        if not data.is_contiguous():
            raise ValueError("crc32c needs a contiguous tensor (its bytes in memory order)")
        # reshape(-1) first: a 0-dim tensor cannot change element size
        return data.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError("crc32c needs a C-contiguous array (its bytes in memory order)")
        return data
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"crc32c needs a bytes-like object, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous buffer (its bytes in memory order)")
    return view


def crc32c(data, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing from ``value`` (the CRC of the bytes before
    it), like ``zlib.crc32(data, value)``: ``crc32c(b, crc32c(a)) == crc32c(a + b)``.

    ``data``: bytes, bytearray, memoryview, a C-contiguous numpy array or CPU torch tensor (its
    bytes), read in place, with the GIL released for more than 32 KiB. Raises ValueError for
    non-contiguous data, TypeError for non-buffers, ``Crc32cUnavailableError`` when the
    ``crc32c`` package is missing.
    """
    if _crc32c is None:
        raise Crc32cUnavailableError(
            "the crc32c package's C extension is not importable; install crc32c from a binary "
            "wheel for this platform (pip install crc32c)")
    if not 0 <= value <= _MASK:
        raise ValueError(f"value must be a CRC-32 in [0, 2**32), got {value}")
    return _crc32c.crc32c(_contiguous_bytes(data), value)


def _multiply(poly: int, a: int, b: int) -> int:
    """a * b modulo the polynomial, both in reflected order (bit 31 is x^0)."""
    product = 0
    mask = 1 << 31
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ poly if b & 1 else b >> 1
    return product


def _powers_of_x(poly: int) -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial for k < _X2N_ENTRIES (squaring the previous one)."""
    power = 1 << 30  # x^1
    powers = [power]
    for _ in range(_X2N_ENTRIES - 1):
        power = _multiply(poly, power, power)
        powers.append(power)
    return tuple(powers)


@dataclass(frozen=True)
class Crc32Polynomial:
    """A reflected 32-bit CRC (initial and final XOR 0xFFFFFFFF), by its polynomial.

    Appending n zero bytes to a message multiplies its pre-conditioning-free CRC register by
    x^(8n) modulo the polynomial: a linear operator over GF(2) (zlib's "zeros operator"), here
    kept in its compact form, one polynomial of degree < 32, instead of zlib's 32x32 bit matrix.
    ``combine`` applies it to the first CRC and adds the second; the table of x^(2^k) is built
    once, when the object is made, so objects are immutable and can be shared between threads.
    """

    reflected: int
    _x2n: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.reflected <= _MASK or not self.reflected & (1 << 31):
            raise ValueError(f"not a reflected 32-bit CRC polynomial (x^0 is bit 31): "
                             f"{self.reflected:#x}")
        object.__setattr__(self, "_x2n", _powers_of_x(self.reflected))

    def shift(self, crc: int, nbytes: int) -> int:
        """The CRC register ``crc`` advanced over ``nbytes`` zero bytes (without the initial
        and final XOR, which cancel in ``combine``)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes >> (_X2N_ENTRIES - 3):
            raise ValueError(f"nbytes must be < 2**{_X2N_ENTRIES - 3}, got {nbytes}")
        power, k = 1 << 31, 3  # x^0; bit j of nbytes contributes x^(2^(j + 3)): 8 bits a byte
        while nbytes:
            if nbytes & 1:
                power = _multiply(self.reflected, self._x2n[k], power)
            nbytes >>= 1
            k += 1
        return _multiply(self.reflected, power, crc)

    def combine(self, crc1: int, crc2: int, len2: int) -> int:
        """CRC of ``a + b`` from ``crc1`` (of a), ``crc2`` (of b) and ``len2 = len(b)``."""
        _check_crcs(crc1=crc1, crc2=crc2)
        return self.shift(crc1, len2) ^ crc2


def _check_crcs(**crcs: int) -> None:
    for name, crc in crcs.items():
        if not 0 <= crc <= _MASK:
            raise ValueError(f"{name} must be a CRC-32 in [0, 2**32), got {crc}")


CRC32C = Crc32Polynomial(0x82F63B78)  # Castagnoli: iSCSI, ext4
CRC32 = Crc32Polynomial(0xEDB88320)   # zlib, gzip, PNG


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """``crc32c(a + b)`` from ``crc1 = crc32c(a)``, ``crc2 = crc32c(b)`` and ``len2 = len(b)``."""
    return CRC32C.combine(crc1, crc2, len2)



def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and
    ``len2 = len(b)``: the same result as ``common.handoff.ledger.crc32_combine``."""
    return CRC32.combine(crc1, crc2, len2)
