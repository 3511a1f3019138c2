"""split_payload -> HandoffAssembler: bitwise round trips, and every refusal with its status code
and exactly one release of what was reserved."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from common.handoff.errors import HandoffError
from common.handoff.manifest import FieldSpec
from common.handoff.parts import ChunkPart, HeaderPart, TrailerPart
from common.handoff.reservation import InMemoryReservation
from common.handoff.stream import HandoffAssembler, assemble_payload, split_payload
from common.logprobs import TokenLogprobs


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(a, b):
    assert a.handoff_id == b.handoff_id and a.fingerprint == b.fingerprint
    assert a.layout == b.layout and a.spec == b.spec and a.first_token == b.first_token
    assert set(a.fields) == set(b.fields)
    for name in a.fields:
        assert a.fields[name].dtype == b.fields[name].dtype, name
        assert a.fields[name].shape == b.fields[name].shape, name
        assert torch.equal(_bytes(a.fields[name]), _bytes(b.fields[name])), name


class Receiver:
    """An assembler over InMemoryReservations that counts reservations and releases."""

    def __init__(self, layout, fingerprint, max_bytes=1 << 40, refuse=None):
        self.reservations: list[InMemoryReservation] = []
        self.refuse = refuse

        def reserve(header):
            if self.refuse:
                raise HandoffError(self.refuse, "no free pages")
            self.reservations.append(InMemoryReservation(header.manifest))
            return self.reservations[-1]

        self.assembler = HandoffAssembler(layout, fingerprint, max_bytes, reserve)

    def feed(self, parts):
        for part in parts:
            self.assembler.on_part(part)
        return self.assembler.on_end()

    def expect_error(self, parts, code):
        with pytest.raises(HandoffError) as info:
            self.feed(parts)
        assert info.value.code == code, info.value
        # every reservation made was released exactly once, none committed
        assert all(r.num_releases == 1 and r.num_commits == 0 for r in self.reservations)
        # the assembler is closed: nothing more is accepted, and abort releases nothing twice
        with pytest.raises(HandoffError) as again:
            self.assembler.on_part(TrailerPart({}))
        assert again.value.code == "ABORTED"
        self.assembler.abort()
        assert all(r.num_releases == 1 for r in self.reservations)
        return info.value


# round trips
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096, 777])
def test_round_trip_bitwise(make_payload, chunk_bytes):
    big = torch.randn(2, 333, 1031)  # fp32, > 1 MiB per layer, odd sizes
    top_k = torch.randint(0, 64, (1, 7), dtype=torch.int64)
    payload = make_payload(prompt_len=37, seed=1, dflash_context=big, top_k=top_k)
    parts = list(split_payload(payload, chunk_bytes=chunk_bytes))
    assert isinstance(parts[0], HeaderPart) and isinstance(parts[-1], TrailerPart)
    chunks = parts[1:-1]
    assert all(0 < len(c.data) <= chunk_bytes for c in chunks)
    assert sum(len(c.data) for c in chunks) == sum(t.numel() * t.element_size()
                                                  for t in payload.fields.values())
    assert_bitwise_equal(payload, assemble_payload(parts))


@pytest.mark.parametrize("prompt_len", [1, 16, 17, 100])
def test_round_trip_prompt_lengths_and_shuffled_chunks(make_payload, layout, fingerprint,
                                                       prompt_len):
    payload = make_payload(prompt_len=prompt_len, seed=prompt_len,
                           logprobs=torch.randn(3, 5, dtype=torch.float64))
    parts = list(split_payload(payload, chunk_bytes=1000))
    chunks = parts[1:-1]
    random.Random(prompt_len).shuffle(chunks)  # chunks may arrive in any order
    receiver = Receiver(layout, fingerprint)
    reservation = receiver.feed([parts[0], *chunks, parts[-1]])
    assert reservation is receiver.reservations[0]
    assert (reservation.num_commits, reservation.num_releases) == (1, 0)
    assert receiver.assembler.bytes_received == sum(len(c.data) for c in chunks)
    got = dataclasses.replace(payload, fields=reservation.tensors)
    assert_bitwise_equal(payload, got)
    receiver.assembler.abort()  # after on_end the reservation is the caller's
    assert reservation.num_releases == 0


def test_empty_layer_field(make_payload):
    payload = make_payload(top_k=torch.zeros(3, 0, dtype=torch.int32))
    assert_bitwise_equal(payload, assemble_payload(split_payload(payload)))


# refusals at the header (nothing reserved yet)
def _with_header(parts, **changes):
    return [dataclasses.replace(parts[0], **changes), *parts[1:]]


def test_unknown_field_in_manifest(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    manifest = {**parts[0].manifest, "hidden_states": FieldSpec("float32", (1, 4))}
    err = Receiver(layout, fingerprint).expect_error(_with_header(parts, manifest=manifest),
                                                     "INVALID_ARGUMENT")
    assert "hidden_states" in str(err)


def test_shape_inconsistent_with_layout(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload(prompt_len=37)))
    manifest = dict(parts[0].manifest)
    manifest["kv"] = FieldSpec("bfloat16", (2, 2, 2, 16, 2, 16))  # 37 tokens need 3 pages
    Receiver(layout, fingerprint).expect_error(_with_header(parts, manifest=manifest),
                                               "INVALID_ARGUMENT")
    manifest["kv"] = dataclasses.replace(parts[0].manifest["kv"], dtype="float16")
    Receiver(layout, fingerprint).expect_error(_with_header(parts, manifest=manifest),
                                               "INVALID_ARGUMENT")


def test_missing_required_field(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    manifest = {k: v for k, v in parts[0].manifest.items() if k != "ssm_state"}
    Receiver(layout, fingerprint).expect_error(_with_header(parts, manifest=manifest),
                                               "INVALID_ARGUMENT")


def test_zero_handoff_id(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    Receiver(layout, fingerprint).expect_error(_with_header(parts, handoff_id=0),
                                               "INVALID_ARGUMENT")


def test_layout_mismatch(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    theirs = dataclasses.replace(layout, page_size=32)
    err = Receiver(layout, fingerprint).expect_error(_with_header(parts, layout=theirs),
                                                     "FAILED_PRECONDITION")
    assert "page_size" in str(err)


def test_fingerprint_mismatch(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    Receiver(layout, fingerprint).expect_error(_with_header(parts, fingerprint="0" * 64),
                                               "FAILED_PRECONDITION")


def test_reserve_refuses(make_payload, layout, fingerprint):
    receiver = Receiver(layout, fingerprint, refuse="RESOURCE_EXHAUSTED")
    receiver.expect_error(split_payload(make_payload()), "RESOURCE_EXHAUSTED")
    assert receiver.reservations == []


def test_payload_over_byte_limit(make_payload, layout, fingerprint):
    receiver = Receiver(layout, fingerprint, max_bytes=1000)
    receiver.expect_error(split_payload(make_payload()), "RESOURCE_EXHAUSTED")
    assert receiver.reservations == []


# refusals after the reservation
def _receive_and_fail(layout, fingerprint, parts, code):
    receiver = Receiver(layout, fingerprint)
    err = receiver.expect_error(parts, code)
    assert len(receiver.reservations) == 1 and receiver.reservations[0].num_releases == 1
    return err


def test_chunk_of_undeclared_field(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    parts.insert(1, ChunkPart("top_k", 0, 0, b"\0" * 8))
    _receive_and_fail(layout, fingerprint, parts, "INVALID_ARGUMENT")


@pytest.mark.parametrize("bad", ["past_end", "layer", "empty"])
def test_chunk_out_of_bounds(make_payload, layout, fingerprint, bad):
    parts = list(split_payload(make_payload()))
    nbytes = parts[0].manifest["conv_state"].layer_nbytes
    chunk = {"past_end": ChunkPart("conv_state", 0, nbytes - 3, b"\0" * 4),
             "layer": ChunkPart("conv_state", 2, 0, b"\0" * 4),
             "empty": ChunkPart("conv_state", 0, 0, b"")}[bad]
    parts.insert(1, chunk)
    _receive_and_fail(layout, fingerprint, parts, "INVALID_ARGUMENT")


@pytest.mark.parametrize("kind", ["duplicate", "overlap"])
def test_duplicate_or_overlapping_chunk(make_payload, layout, fingerprint, kind):
    parts = list(split_payload(make_payload(), chunk_bytes=100))
    first = parts[1]
    extra = first if kind == "duplicate" else ChunkPart(first.field, first.layer, 50, b"\0" * 60)
    parts.insert(2, extra)
    _receive_and_fail(layout, fingerprint, parts, "INVALID_ARGUMENT")


def test_missing_chunk(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload(), chunk_bytes=100))
    del parts[5]
    err = _receive_and_fail(layout, fingerprint, parts, "DATA_LOSS")
    assert "missing" in str(err)


def test_corrupted_bytes(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload(), chunk_bytes=100))
    c = parts[3]
    parts[3] = dataclasses.replace(c, data=bytes([c.data[0] ^ 1]) + c.data[1:])
    _receive_and_fail(layout, fingerprint, parts, "DATA_LOSS")


def test_bad_checksum(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    sums = dict(parts[-1].checksums)
    sums["ssm_state"] ^= 0x1
    parts[-1] = TrailerPart(sums, first_token=5)
    err = _receive_and_fail(layout, fingerprint, parts, "DATA_LOSS")
    assert "ssm_state" in str(err)


def test_trailer_with_wrong_fields(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    parts[-1] = TrailerPart({k: v for k, v in parts[-1].checksums.items() if k != "kv"},
                            first_token=5)
    _receive_and_fail(layout, fingerprint, parts, "INVALID_ARGUMENT")


def test_stream_ends_before_trailer(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    _receive_and_fail(layout, fingerprint, parts[:-1], "DATA_LOSS")


def test_out_of_sequence(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    Receiver(layout, fingerprint).expect_error(parts[1:], "INVALID_ARGUMENT")  # no header
    _receive_and_fail(layout, fingerprint, [parts[0], *parts], "INVALID_ARGUMENT")  # 2 headers
    _receive_and_fail(layout, fingerprint, [*parts, parts[1]], "INVALID_ARGUMENT")  # after end


def test_abort_releases_once(make_payload, layout, fingerprint):
    parts = list(split_payload(make_payload()))
    receiver = Receiver(layout, fingerprint)
    receiver.assembler.on_part(parts[0])
    receiver.assembler.on_part(parts[1])
    receiver.assembler.abort()
    receiver.assembler.abort()
    assert receiver.reservations[0].num_releases == 1
    with pytest.raises(HandoffError) as info:
        receiver.assembler.on_end()
    assert info.value.code == "ABORTED"
    with pytest.raises(HandoffError) as info:
        receiver.assembler.on_part(parts[2])
    assert info.value.code == "ABORTED"


def test_broken_reservation_is_released(make_payload, layout, fingerprint):
    class Broken(InMemoryReservation):
        def write(self, field, layer, offset, data):
            raise ValueError("a receiver bug: the write did not fit its destination")

    made = []

    def reserve(header):
        made.append(Broken(header.manifest))
        return made[-1]

    assembler = HandoffAssembler(layout, fingerprint, 1 << 40, reserve)
    parts = list(split_payload(make_payload()))
    assembler.on_part(parts[0])
    with pytest.raises(ValueError):
        assembler.on_part(parts[1])
    assembler.abort()
    assert made[0].num_releases == 1


def test_commit_failure_is_released(make_payload, layout, fingerprint):
    class Failing(InMemoryReservation):
        def commit(self):
            raise RuntimeError("device copy failed")

    made = []

    def reserve(header):
        made.append(Failing(header.manifest))
        return made[-1]

    assembler = HandoffAssembler(layout, fingerprint, 1 << 40, reserve)
    for part in split_payload(make_payload()):
        assembler.on_part(part)
    with pytest.raises(RuntimeError):
        assembler.on_end()
    assert made[0].num_releases == 1


def test_sender_rejects_payload_that_breaks_its_layout(make_payload):
    payload = make_payload()
    payload.fields["conv_state"] = payload.fields["conv_state"][:1]
    with pytest.raises(HandoffError) as info:
        next(split_payload(payload))
    assert info.value.code == "INVALID_ARGUMENT"


def test_trailer_without_first_token_is_invalid(layout, fingerprint, make_payload):
    parts = list(split_payload(make_payload(9)))
    parts[-1] = TrailerPart(parts[-1].checksums)
    _receive_and_fail(layout, fingerprint, parts, "INVALID_ARGUMENT")


# the first token's log-probabilities, in the trailer
def _asking(payload, num_top, logprobs):
    spec = dataclasses.replace(payload.spec, sampling=dataclasses.replace(
        payload.spec.sampling, logprobs=num_top))
    return dataclasses.replace(payload, first_logprobs=logprobs, spec=spec)


def test_first_token_logprobs_travel_in_the_trailer(make_payload):
    logprobs = TokenLogprobs(-0.5, ((5, -0.5), (9, -1.25)))
    payload = _asking(make_payload(), 2, logprobs)
    got = assemble_payload(split_payload(payload))
    assert got.first_logprobs == logprobs and got.spec.sampling.logprobs == 2


@pytest.mark.parametrize("num_top,logprobs", [
    (2, None),                                    # asked for, missing
    (None, TokenLogprobs(-0.5)),                  # not asked for, sent
    (3, TokenLogprobs(-0.5, ((5, -0.5),))),       # fewer alternatives than asked for
])
def test_first_token_logprobs_must_be_what_the_request_asks(make_payload, layout, fingerprint,
                                                            num_top, logprobs):
    parts = list(split_payload(_asking(make_payload(), num_top, logprobs)))
    err = _receive_and_fail(layout, fingerprint, parts, "INVALID_ARGUMENT")
    assert "log-probabilities" in str(err)


# a field the receiver declined (the draft context of a request it decodes without the draft)
def _declining(layout, fingerprint, header):
    assembler = HandoffAssembler(layout, fingerprint, 1 << 40)
    assembler.check_header(header)
    reservation = InMemoryReservation(header.manifest)
    assembler.start(header, reservation, declined=frozenset({"dflash_context"}))
    return assembler, reservation


def test_a_declined_field_is_neither_sent_nor_checksummed(make_payload, layout, fingerprint):
    payload = make_payload(prompt_len=21, seed=3, dflash_context=torch.randn(2, 50, 9))
    header, *chunks, trailer = split_payload(payload, chunk_bytes=500)
    assembler, reservation = _declining(layout, fingerprint, header)
    for chunk in chunks:
        if chunk.field != "dflash_context":
            assembler.on_chunk(chunk)
    assembler.on_trailer(TrailerPart({k: v for k, v in trailer.checksums.items()
                                      if k != "dflash_context"}, first_token=5))
    assert assembler.on_end() is reservation and reservation.num_commits == 1


@pytest.mark.parametrize("sent", ["chunk", "checksum"])
def test_a_declined_field_that_comes_anyway_is_refused(make_payload, layout, fingerprint, sent):
    payload = make_payload(prompt_len=21, seed=3, dflash_context=torch.randn(2, 50, 9))
    header, *chunks, trailer = split_payload(payload, chunk_bytes=500)
    assembler, reservation = _declining(layout, fingerprint, header)
    with pytest.raises(HandoffError) as err:
        for chunk in chunks:
            if sent == "chunk" or chunk.field != "dflash_context":
                assembler.on_chunk(chunk)
        assembler.on_trailer(trailer)  # with the declined field's checksum
    assert err.value.code == "INVALID_ARGUMENT"
    assert reservation.num_releases == 1 and reservation.num_commits == 0
