"""LayerLedger: out-of-order and claimed-then-recorded pieces fold to crc32c of the whole;
gaps, overlaps and ranges still landing are found; a message's payload CRC skips its prefix."""

from __future__ import annotations

import os

import pytest

from common.handoff.checksum import crc32c
from common.handoff.chunk_codec import encode_chunk
from common.handoff.errors import HandoffError
from common.handoff.ledger import LayerLedger, message_payload_crc


def test_ledger_folds_out_of_order_pieces():
    data = os.urandom(1000)
    ledger = LayerLedger(len(data))
    for start in (600, 0, 250, 900):
        end = {0: 250, 250: 600, 600: 900, 900: 1000}[start]
        ledger.add(start, data[start:end], "test")
    assert ledger.fold(0, "test") == crc32c(data)
    assert ledger.fold(crc32c(b"xy"), "test") == crc32c(b"xy" + data)


def test_claimed_ranges_fold_once_recorded():
    data = os.urandom(300)
    ledger = LayerLedger(len(data))
    ledger.claim(100, 200, "t")
    ledger.claim(0, 100, "t")
    ledger.record(0, crc32c(data[:100]))
    with pytest.raises(HandoffError) as landing:  # [100, 300) has no CRC yet
        ledger.fold(0, "t")
    assert landing.value.code == "DATA_LOSS" and "offset 100" in landing.value.message
    ledger.record(100, crc32c(data[100:]))
    assert ledger.fold(0, "t") == crc32c(data)
    with pytest.raises(ValueError):
        ledger.record(50, 0)


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
    with pytest.raises(HandoffError):
        ledger.claim(4, 2, "t")
    ledger.add(3, b"de", "t")
    assert ledger.fold(0, "t") == crc32c(b"abcdefghij")


@pytest.mark.parametrize("nbytes", [0, 1, 4097, (1 << 20) + 3])
def test_message_payload_crc_is_the_data_crc(nbytes):
    data = os.urandom(nbytes)
    message = encode_chunk("kv", 3, 12345, data)
    start = len(message) - nbytes
    assert message[start:] == data
    assert message_payload_crc(message, start) == crc32c(data)
    with pytest.raises(ValueError):
        message_payload_crc(message, len(message) + 1)
