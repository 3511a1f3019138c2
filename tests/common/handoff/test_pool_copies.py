"""The device transport's copies: coverage, overlap, and mixing with bytes are checked."""

from __future__ import annotations

import pytest

from common.handoff.errors import HandoffError
from common.handoff.parts import ChunkPart, PoolCopyPart, TrailerPart
from common.handoff.pool_copies import PoolCopyLedger
from common.handoff.reservation import InMemoryReservation
from common.handoff.stream import HandoffAssembler, split_payload

DECLARED = {"kv", "conv_state", "ssm_state"}


def test_pages_in_any_order_cover_the_field():
    ledger = PoolCopyLedger(num_pages=5)
    ledger.add(PoolCopyPart("kv", (9, 8), 3), DECLARED)
    ledger.add(PoolCopyPart("kv", (1, 2, 3), 0), DECLARED)
    ledger.check_complete("kv")
    ledger.add(PoolCopyPart("ssm_state", (4,)), DECLARED)
    ledger.check_complete("ssm_state")


@pytest.mark.parametrize("part", [
    PoolCopyPart("kv", (), 0),                 # empty
    PoolCopyPart("kv", (1, 2), 4),             # past the prompt's pages
    PoolCopyPart("dflash_context", (1,), 0),   # not declared
    PoolCopyPart("top_k", (1,), 0),            # not a pool field
    PoolCopyPart("conv_state", (1, 2)),        # a state comes from one slot
])
def test_bad_copies_are_invalid(part):
    with pytest.raises(HandoffError) as err:
        PoolCopyLedger(num_pages=5).add(part, DECLARED)
    assert err.value.code == "INVALID_ARGUMENT"


def test_overlap_is_invalid_and_a_gap_is_data_loss():
    ledger = PoolCopyLedger(num_pages=4)
    ledger.add(PoolCopyPart("kv", (1, 2), 0), DECLARED)
    with pytest.raises(HandoffError, match="overlaps"):
        ledger.add(PoolCopyPart("kv", (7,), 1), DECLARED)
    with pytest.raises(HandoffError) as err:
        ledger.check_complete("kv")
    assert err.value.code == "DATA_LOSS"


class CopyingReservation(InMemoryReservation):
    def __init__(self, manifest):
        super().__init__(manifest)
        self.copies = []

    def copy_from(self, part):
        self.copies.append(part)


def assembler_for(layout, fingerprint, payload, pool_copies):
    made = []
    assembler = HandoffAssembler(layout, fingerprint, 1 << 40)
    header = next(iter(split_payload(payload)))
    assembler.check_header(header)
    made.append(CopyingReservation(header.manifest))
    assembler.start(header, made[0], pool_copies=pool_copies)
    return assembler, made[0]


def test_a_handoff_of_pool_copies_completes_without_checksums(layout, fingerprint, make_payload):
    payload = make_payload(37)
    assembler, res = assembler_for(layout, fingerprint, payload, pool_copies=True)
    pages = layout.num_pages(37)
    for part in [PoolCopyPart("kv", tuple(range(10, 10 + pages)), 0),
                 PoolCopyPart("conv_state", (3,)), PoolCopyPart("ssm_state", (3,))]:
        assembler.on_part(part)
    assembler.on_part(TrailerPart({}, first_token=5))
    assert assembler.on_end() is res and len(res.copies) == 3 and assembler.first_token == 5


def test_copies_need_acceptance_and_never_mix_with_bytes(layout, fingerprint, make_payload):
    payload = make_payload(37)
    assembler, res = assembler_for(layout, fingerprint, payload, pool_copies=False)
    with pytest.raises(HandoffError, match="not accepted for pool copies"):
        assembler.on_part(PoolCopyPart("kv", (1,), 0))
    assert res.num_releases == 1
    assembler, res = assembler_for(layout, fingerprint, payload, pool_copies=True)
    chunk = next(p for p in split_payload(payload) if isinstance(p, ChunkPart)
                 and p.field == "kv")
    assembler.on_part(chunk)
    with pytest.raises(HandoffError, match="as bytes and as pool copies"):
        assembler.on_part(PoolCopyPart("kv", (1,), 0))
    assert res.num_releases == 1
