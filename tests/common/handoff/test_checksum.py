"""crc32c: known vectors, every accepted buffer type read in place, continuation; the combine of
both polynomials equals the CRC of the concatenation; a missing C extension is refused."""

from __future__ import annotations

import random
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

import crc32c as crc32c_package
from common.handoff import checksum
from common.handoff.checksum import (CRC32, CRC32C, Crc32Polynomial, crc32_combine, crc32c,
                                     crc32c_combine,
                                     fast_crc32c_available)
from tests.common.handoff.gil_probe import counter_moves

CHECK = b"123456789"


def test_c_extension_is_in_use():
    assert fast_crc32c_available()
    assert checksum.hardware_crc32c() == bool(crc32c_package.hardware_based)


def test_known_vectors():
    assert crc32c(CHECK) == 0xE3069283                  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA               # RFC 3720 B.4: 32 bytes of zeros
    assert crc32c(b"\xff" * 32) == 0x62A8AB43            # RFC 3720 B.4: 32 bytes of 0xff
    assert crc32c(bytes(range(32))) == 0x46DD794E        # RFC 3720 B.4: incrementing


@pytest.mark.parametrize("wrap", [
    bytes, bytearray, memoryview, lambda b: memoryview(bytearray(b)),
    lambda b: np.frombuffer(b, dtype=np.uint8),
    lambda b: torch.tensor(list(b), dtype=torch.uint8),
], ids=["bytes", "bytearray", "memoryview", "memoryview-rw", "numpy", "torch"])
def test_buffer_types(wrap):
    assert crc32c(wrap(CHECK)) == 0xE3069283
    assert crc32c(wrap(b"")) == 0


def test_reads_in_place_without_a_copy():
    # a view of a larger array: its bytes are read where they are, and a change shows up
    base = np.zeros(1 << 16, dtype=np.uint8)
    view = base[100:200]
    before = crc32c(view)
    base[150] = 1
    assert crc32c(view) != before
    assert crc32c(memoryview(base)[100:200]) == crc32c(view) == crc32c(view.tobytes())


def test_other_dtypes_are_their_bytes():
    t = torch.randn(7, 5, dtype=torch.float32).to(torch.bfloat16)
    expected = crc32c(t.view(torch.uint8).numpy().tobytes())
    assert crc32c(t) == expected
    assert crc32c(t.view(torch.int16).numpy()) == expected
    assert crc32c(memoryview(t.view(torch.int16).numpy())) == expected
    scalar = torch.tensor(3.5)
    assert crc32c(scalar) == crc32c(scalar.numpy().tobytes())


def test_continuation_matches_concatenation():
    data = random.randbytes(10_001)
    for cut in (0, 1, 4096, 10_000, 10_001):
        assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data)


def test_refuses_caller_mistakes():
    with pytest.raises(ValueError, match="contiguous"):
        crc32c(np.zeros((4, 4), dtype=np.uint8)[:, 1])
    with pytest.raises(ValueError, match="contiguous"):
        crc32c(torch.zeros(4, 4, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="contiguous"):
        crc32c(memoryview(bytes(16))[::2])
    with pytest.raises(TypeError, match="bytes-like"):
        crc32c("123456789")
    with pytest.raises(ValueError, match="CRC-32"):
        crc32c(CHECK, value=1 << 32)
    with pytest.raises(ValueError):
        crc32c_combine(0, 0, -1)
    with pytest.raises(ValueError):
        crc32c_combine(-1, 0, 1)
    with pytest.raises(ValueError, match="polynomial"):
        Crc32Polynomial(0x1EDC6F41)  # the normal (not reflected) form of Castagnoli's


SPLITS = [(0, 0), (0, 5), (5, 0), (1, 1), (3, 7), (13, 1000), (1000, 13), (4096, 4096),
          (3, (1 << 20) + 7), ((1 << 16) + 1, 65_537)]


@pytest.mark.parametrize("len_a,len_b", SPLITS)
def test_crc32c_combine_equals_concatenation(len_a, len_b):
    rng = random.Random(len_a * 1_000_003 + len_b)
    a, b = rng.randbytes(len_a), rng.randbytes(len_b)
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@pytest.mark.parametrize("len_a,len_b", SPLITS)
def test_zlib_polynomial_combine_equals_zlib(len_a, len_b):
    rng = random.Random(len_a + 7 * len_b)
    a, b = rng.randbytes(len_a), rng.randbytes(len_b)
    crc_a, crc_b = zlib.crc32(a), zlib.crc32(b)
    assert crc32_combine(crc_a, crc_b, len(b)) == zlib.crc32(a + b)


def test_random_splits_fold_in_order():
    rng = random.Random(5)
    data = rng.randbytes(200_003)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randrange(1, 12)))
        pieces = [data[s:e] for s, e in zip([0, *cuts], [*cuts, len(data)])]
        folded = 0
        for piece in pieces:
            folded = crc32c_combine(folded, crc32c(piece), len(piece))
        assert folded == crc32c(data)


def test_huge_lengths_are_consistent():
    # combining over 2**40 zero bytes in one go or in two halves gives the same register
    half = CRC32C.shift(0x1234_5678, 1 << 39)
    assert CRC32C.shift(half, 1 << 39) == CRC32C.shift(0x1234_5678, 1 << 40)
    assert CRC32.shift(0xDEAD_BEEF, 0) == 0xDEAD_BEEF


def test_missing_extension_is_refused():
    # A process where the crc32c package cannot load: crc32c refuses with a clear error, and
    # folding (pure Python) still works.
    code = ("import sys; sys.modules['crc32c'] = None\n"
            "from common.handoff.checksum import crc32c, fast_crc32c_available, "
            "crc32c_combine, Crc32cUnavailableError\n"
            "assert not fast_crc32c_available()\n"
            "assert crc32c_combine(1, 2, 3) >= 0\n"
            "try:\n    crc32c(b'x')\nexcept Crc32cUnavailableError:\n    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(checksum.__file__).rsplit("/common/", 1)[0], check=True)
    assert out.stdout.strip() == "refused"


def test_the_gil_is_released_over_a_view():
    # google-crc32c over an ndarray held it: the counter stayed at 0
    data = memoryview(np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8))
    moved = counter_moves(lambda: crc32c(data))
    assert min(moved) > 1000, moved
