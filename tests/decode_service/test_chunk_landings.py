"""ChunkLandings: chunks land on writer threads several at once and the trailer checks them
all; a failing chunk fails the handoff, and nothing still writes once it has settled."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.handoff.chunk_codec import decode_chunk, encode_chunk
from common.handoff.errors import HandoffError
from common.handoff.parts import ChunkPart, HeaderPart, PoolCopyPart, TrailerPart
from common.handoff.reservation import InMemoryReservation
from common.handoff.stream import HandoffAssembler, split_payload
from decode_service.chunk_landings import ChunkLandings


class SlowReservation(InMemoryReservation):
    """Counts writes running at once; the ``fail_at``-th write raises."""

    def __init__(self, manifest, fail_at: int | None = None) -> None:
        super().__init__(manifest)
        self.lock = threading.Lock()
        self.running = self.most_running = self.writes = 0
        self.fail_at = fail_at

    def write(self, field, layer, offset, data) -> None:
        with self.lock:
            self.writes += 1
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            n = self.writes
        try:
            time.sleep(0.003)
            if n == self.fail_at:
                raise HandoffError("DATA_LOSS", "copy failed")
            super().write(field, layer, offset, data)
        finally:
            with self.lock:
                self.running -= 1


def wire(payload, chunk_bytes=97):
    """(part, message bytes, raw) for every part of ``payload`` as it comes off the wire."""
    out = []
    for part in split_payload(payload, chunk_bytes):
        if isinstance(part, ChunkPart):
            message = encode_chunk(part.field, part.layer, part.offset, part.data)
            raw = decode_chunk(message)
            part = ChunkPart(raw.field, raw.layer, raw.offset, raw.data)
            out.append((part, message, raw))
        else:
            out.append((part, None, None))
    return out


def receive(layout, fingerprint, payload, reservation, max_in_flight=4, parts=None):
    """Feed ``parts`` (default: the payload as it comes off the wire; ``(part, message, raw)``
    each) through ChunkLandings as the decode handler does; the handoff's reservation."""
    assembler = HandoffAssembler(layout, fingerprint, 1 << 30)
    pool_copies = parts is not None and any(isinstance(p, PoolCopyPart) for p, _, _ in parts)

    async def run():
        landings = ChunkLandings(assembler, writer, max_in_flight)
        try:
            for part, message, raw in parts if parts is not None else wire(payload):
                if isinstance(part, HeaderPart):
                    assembler.check_header(part)
                    assembler.start(part, reservation, pool_copies=pool_copies)
                elif isinstance(part, ChunkPart):
                    await landings.add(part, message, raw)
                elif isinstance(part, PoolCopyPart):
                    await landings.add_pool_copy(part)  # returns while the copy runs
                else:
                    assert isinstance(part, TrailerPart)
                    await landings.drain()
                    assembler.on_part(part)
            return assembler.on_end()
        except BaseException:
            await landings.settle()
            assembler.abort()
            raise

    with ThreadPoolExecutor(max_workers=3) as writer:
        return asyncio.run(run())


def test_chunks_land_concurrently_and_verify(layout, fingerprint, make_payload):
    payload = make_payload(prompt_len=41, seed=3)
    reservation = SlowReservation(payload.manifest())
    receive(layout, fingerprint, payload, reservation)
    assert reservation.most_running > 1
    assert reservation.num_commits == 1 and reservation.num_releases == 0
    for name, tensor in payload.fields.items():
        assert torch.equal(reservation.tensors[name], tensor), name


def test_a_failed_chunk_fails_the_handoff_after_every_write_ended(layout, fingerprint,
                                                                  make_payload):
    payload = make_payload(prompt_len=41, seed=4)
    reservation = SlowReservation(payload.manifest(), fail_at=5)
    with pytest.raises(HandoffError) as failed:
        receive(layout, fingerprint, payload, reservation)
    assert failed.value.code == "DATA_LOSS"
    assert reservation.running == 0  # settled: nothing writes into released room
    assert reservation.num_releases == 1 and reservation.num_commits == 0


def test_max_in_flight_must_be_positive(layout, fingerprint):
    with pytest.raises(ValueError):
        ChunkLandings(HandoffAssembler(layout, fingerprint, 1), None, 0)


class CopyingReservation(InMemoryReservation):
    """Records pool copies, each taking a while; the ``fail_at``-th raises."""

    def __init__(self, manifest, fail_at: int | None = None) -> None:
        super().__init__(manifest)
        self.lock = threading.Lock()
        self.copies, self.running, self.most_running, self.started = [], 0, 0, 0
        self.fail_at = fail_at

    def copy_from(self, part) -> None:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.started += 1
            n = self.started
        try:
            time.sleep(0.02)
            if n == self.fail_at:
                raise HandoffError("INVALID_ARGUMENT", "a pool copy outside the sender's pool")
            with self.lock:
                self.copies.append(part)
        finally:
            with self.lock:
                self.running -= 1


def copy_handoff(layout, fingerprint, payload, reservation):
    pages = layout.num_pages(payload.prompt_len)
    copies = [PoolCopyPart("kv", tuple(range(10, 10 + pages)), 0),
              PoolCopyPart("conv_state", (3,)), PoolCopyPart("ssm_state", (3,))]
    parts = [next(iter(split_payload(payload))), *copies, TrailerPart({}, first_token=5)]
    return receive(layout, fingerprint, payload, reservation,
                   parts=[(part, None, None) for part in parts])


def test_pool_copies_run_while_the_next_parts_are_read(layout, fingerprint, make_payload):
    payload = make_payload(prompt_len=37, seed=5)
    reservation = CopyingReservation(payload.manifest())
    assert copy_handoff(layout, fingerprint, payload, reservation) is reservation
    assert len(reservation.copies) == 3 and reservation.most_running > 1
    assert reservation.num_commits == 1


def test_a_failed_pool_copy_fails_the_handoff_after_every_copy_ended(layout, fingerprint,
                                                                     make_payload):
    payload = make_payload(prompt_len=37, seed=6)
    reservation = CopyingReservation(payload.manifest(), fail_at=2)
    with pytest.raises(HandoffError, match="outside the sender's pool") as failed:
        copy_handoff(layout, fingerprint, payload, reservation)
    assert failed.value.code == "INVALID_ARGUMENT"
    assert reservation.running == 0
    assert reservation.num_releases == 1 and reservation.num_commits == 0
