"""crc32_combine equals zlib.crc32 over the concatenation; LayerLedger finds gaps and overlaps."""

from __future__ import annotations

import os
import zlib

import pytest

from common.handoff.errors import HandoffError
from common.handoff.ledger import LayerLedger, crc32_combine


@pytest.mark.parametrize("len_a,len_b", [(0, 0), (0, 5), (5, 0), (1, 1), (13, 1000),
                                         (3, (1 << 20) + 7)])
def test_crc32_combine(len_a, len_b):
    a, b = os.urandom(len_a), os.urandom(len_b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_ledger_folds_out_of_order_pieces():
    data = os.urandom(1000)
    ledger = LayerLedger(len(data))
    for start in (600, 0, 250, 900):
        end = {0: 250, 250: 600, 600: 900, 900: 1000}[start]
        ledger.add(start, data[start:end], "test")
    assert ledger.fold(0, "test") == zlib.crc32(data)
    assert ledger.fold(zlib.crc32(b"xy"), "test") == zlib.crc32(b"xy" + data)


def test_ledger_gap_and_overlap():
    ledger = LayerLedger(10)
    ledger.add(0, b"abc", "t")
    ledger.add(5, b"fghij", "t")
    with pytest.raises(HandoffError) as gap:
        ledger.fold(0, "t")
    assert gap.value.code == "DATA_LOSS" and "offset 3" in gap.value.message
    for start, data in ((2, b"x"), (4, b"xy"), (0, b"abc"), (9, b"j")):
        with pytest.raises(HandoffError) as overlap:
            ledger.add(start, data, "t")
        assert overlap.value.code == "INVALID_ARGUMENT"
    ledger.add(3, b"de", "t")
    assert ledger.fold(0, "t") == zlib.crc32(b"abcdefghij")
