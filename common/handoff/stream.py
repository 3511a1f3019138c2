"""A payload as a sequence of parts (sender), and the receiver's state machine that checks them.

Sender: ``split_payload`` yields a header, chunks of at most ``chunk_bytes``, and a trailer of
per-field CRC-32Cs. Receiver: ``HandoffAssembler`` validates each part as it arrives and writes chunk
bytes straight into a ``Reservation``; every refusal is a ``HandoffError`` whose code is the gRPC
status to answer with (docs/protocol.md), and every refusal releases the reservation exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from common.handoff.bands import BANDED_FIELDS
from common.handoff.checksum import crc32c
from common.handoff.errors import HandoffError
from common.handoff.layout import LayoutDescriptor
from common.handoff.ledger import LayerLedger, fold_checksums
from common.handoff.manifest import KNOWN_FIELDS, validate_manifest
from common.handoff.parts import ChunkPart, HandoffPart, HeaderPart, PoolCopyPart, TrailerPart
from common.handoff.pool_copies import PoolCopyLedger
from common.handoff.payload import HandoffPayload
from common.handoff.reservation import InMemoryReservation, Reservation
from common.logprobs import TokenLogprobs, check_asked

DEFAULT_CHUNK_BYTES = 1 << 20  # well under gRPC's 4 MiB default message limit
_MAX_HANDOFF_ID = (1 << 64) - 1


def _layer_bytes(tensor: torch.Tensor, layer: int) -> memoryview:
    # reshape(-1) first: a view of a 0-dim layer cannot change element size.
    flat = tensor[layer].detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.cpu().numpy())


def split_payload(payload: HandoffPayload,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[HandoffPart]:
    """Yield ``payload`` as a ``HeaderPart``, ``ChunkPart``s (each <= ``chunk_bytes``, in field,
    layer, offset order) and a ``TrailerPart``. Raises INVALID_ARGUMENT before yielding anything if
    the payload does not fit its own layout."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    payload.validate()
    yield header_of(payload)
    checksums = {}
    for name in sorted(payload.fields, key=KNOWN_FIELDS.index):
        tensor = payload.fields[name]
        crc = 0
        for layer in range(tensor.shape[0]):
            data = _layer_bytes(tensor, layer)  # one layer at a time bounds host staging memory
            for offset in range(0, len(data), chunk_bytes):
                piece = bytes(data[offset:offset + chunk_bytes])
                crc = crc32c(piece, crc)
                yield ChunkPart(field=name, layer=layer, offset=offset, data=piece)
        checksums[name] = crc
    yield TrailerPart(checksums=checksums, first_token=payload.first_token,
                      first_logprobs=payload.first_logprobs)


def header_of(payload: HandoffPayload) -> HeaderPart:
    """The header that announces ``payload`` (everything but its bytes and first token)."""
    return HeaderPart(handoff_id=payload.handoff_id, fingerprint=payload.fingerprint,
                      layout=payload.layout, spec=payload.spec, manifest=payload.manifest())


class HandoffAssembler:
    """Receiver state machine for one handoff: header -> chunks (any order) -> trailer.

    Args:
        expected_layout: the receiver's layout; the header's must equal it.
        expected_fingerprint: the receiver's model fingerprint; the header's must equal it.
        max_bytes: most payload bytes accepted (RESOURCE_EXHAUSTED above it).
        reserve: called by ``on_header`` once the header is valid; returns where the bytes go,
            or raises ``HandoffError`` (RESOURCE_EXHAUSTED when there is no room, ABORTED when
            the request was cancelled). If it raises, it must itself free anything it took.
            None when the caller reserves by itself: ``check_header``, then ``start``.

    Use: ``on_part`` for every message, then ``on_end`` when the sender closes its stream, which
    commits the reservation and hands it to the caller; ``abort`` in a ``finally`` (a no-op once
    done). Until ``on_end`` returns, any error or ``abort`` releases the reservation exactly once.
    Not thread-safe: one handler feeds one assembler.
    """

    def __init__(self, expected_layout: LayoutDescriptor, expected_fingerprint: str,
                 max_bytes: int,
                 reserve: Callable[[HeaderPart], Reservation] | None = None) -> None:
        self._layout = expected_layout
        self._fingerprint = expected_fingerprint
        self._max_bytes = max_bytes
        self._reserve = reserve
        self._state = "header"  # -> "chunks" -> "verified" -> "done"; "closed" on any failure
        self._header: HeaderPart | None = None
        self._reservation: Reservation | None = None
        self._ledgers: dict[tuple[str, int], LayerLedger] = {}
        self._copies: PoolCopyLedger | None = None
        self._bands: set[str] | None = None  # per-rank streams' band names
        self._declined: frozenset[str] = frozenset()  # manifest fields not to be sent
        self.bytes_received = 0
        self.first_token: int | None = None  # from the verified trailer
        self.first_logprobs: TokenLogprobs | None = None  # likewise, when the request asks

    @property
    def header(self) -> HeaderPart | None:
        """The validated header, once one arrived."""
        return self._header

    @property
    def is_done(self) -> bool:
        return self._state == "done"

    def on_part(self, part: HandoffPart) -> None:
        """Dispatch one part to ``on_header``, ``on_chunk`` or ``on_trailer``."""
        if isinstance(part, HeaderPart):
            self.on_header(part)
        elif isinstance(part, ChunkPart):
            self.on_chunk(part)
        elif isinstance(part, TrailerPart):
            self.on_trailer(part)
        elif isinstance(part, PoolCopyPart):
            self.on_pool_copy(part)
        else:
            self._fail(HandoffError("INVALID_ARGUMENT", f"not a handoff part: {type(part)!r}"))

    def on_header(self, header: HeaderPart) -> None:
        """Validate the header, then reserve room for the payload it declares."""
        self.check_header(header)
        try:
            if self._reserve is None:
                raise ValueError("this assembler has no reserve function: use check_header "
                                 "and start")
            reservation = self._reserve(header)
        except BaseException as err:
            self._fail(err)
        self.start(header, reservation)

    def check_header(self, header: HeaderPart) -> None:
        """Validate the header (before anything is reserved for it); raises ``HandoffError``.
        A caller that reserves by itself (on another thread) then calls :meth:`start`."""
        self._expect("header", "a second header" if self._header else "a header")
        try:
            if not 0 < header.handoff_id <= _MAX_HANDOFF_ID:
                raise HandoffError("INVALID_ARGUMENT",
                                   f"handoff_id must be a non-zero uint64, got {header.handoff_id}")
            if header.fingerprint != self._fingerprint:
                raise HandoffError("FAILED_PRECONDITION",
                                   f"model fingerprint {header.fingerprint!r} differs from ours "
                                   f"{self._fingerprint!r}: the workers serve different models")
            self._layout.check_compatible(header.layout)
            validate_manifest(self._layout, header.prompt_len, header.manifest)
            if header.payload_nbytes > self._max_bytes:
                raise HandoffError("RESOURCE_EXHAUSTED", f"payload of {header.payload_nbytes} "
                                   f"bytes exceeds the limit of {self._max_bytes}")
        except BaseException as err:
            self._fail(err)

    def start(self, header: HeaderPart, reservation: Reservation, *,
              pool_copies: bool = False, bands: set[str] | None = None,
              declined: frozenset[str] = frozenset()) -> None:
        """Take the room reserved for a checked header; chunks may follow (and, with
        ``pool_copies``, the reservation opened the sender's pools: ``PoolCopyPart``s too).
        ``bands``: the state's fields (``kv``, ``conv_state``, ``ssm_state``) come on per-rank
        streams as these bands instead (``common/handoff/bands.py``): no chunk of them may
        come here, and the trailer must carry a checksum of each band, which the caller
        checks against what the ranks landed. ``declined``: manifest fields the receiver told
        the sender not to send (``dflash_context`` of a request it decodes without the draft):
        none of their bytes may come, and the trailer carries no checksum of them. If the
        handoff was closed meanwhile, the reservation is released at once (and ABORTED
        raised)."""
        if self._state != "header":
            reservation.release()
            self._expect("header", "a reservation")
        self._reservation = reservation
        self._header = header
        self._copies = (PoolCopyLedger(header.layout.num_pages(header.prompt_len))
                        if pool_copies else None)
        self._bands = set(bands) if bands is not None else None
        self._declined = frozenset(declined)
        self._state = "chunks"

    def on_pool_copy(self, part: PoolCopyPart) -> None:
        """Check a ``device`` transport copy and run it (``reservation.copy_from``)."""
        self.claim_pool_copy(part)
        try:
            self.run_pool_copy(part)
        except BaseException as err:
            self._fail(err)

    def claim_pool_copy(self, part: PoolCopyPart) -> None:
        """Check a ``device`` transport copy and claim its pages, before it runs. A receiver
        running copies on other threads calls this on the thread that feeds the assembler,
        then ``run_pool_copy`` on a thread; the trailer may come only once every copy ran."""
        self._expect("chunks", "a pool copy")
        try:
            if self._copies is None:
                raise HandoffError("INVALID_ARGUMENT", "a pool copy, but this handoff was not "
                                   "accepted for pool copies")
            if any(key[0] == part.field for key in self._ledgers):
                raise HandoffError("INVALID_ARGUMENT", f"field {part.field!r} arrives as bytes "
                                   "and as pool copies")
            self._copies.add(part, set(self._header.manifest) - self._declined)
        except BaseException as err:
            self._fail(err)

    def run_pool_copy(self, part: PoolCopyPart) -> None:
        """Run a claimed copy (any thread, concurrently with others); ABORTED once the handoff
        was closed. Raising here does not close the assembler: the feeding thread gets the
        error and calls ``abort``."""
        reservation = self._reservation
        if reservation is None or self._state != "chunks":
            raise HandoffError("ABORTED", "the handoff was closed while its copies ran")
        reservation.copy_from(part)

    def on_chunk(self, chunk: ChunkPart) -> None:
        """Check the chunk's address and write its bytes into the reservation."""
        self.claim_chunk(chunk)
        self.record_chunk(chunk, self.land_chunk(chunk))

    def claim_chunk(self, chunk: ChunkPart) -> None:
        """Check the chunk's address and claim its bytes (refusing an overlap), before they
        land. A receiver landing chunks on other threads calls this, then ``land_chunk`` on a
        thread, then ``record_chunk`` with its result, all but ``land_chunk`` on the thread
        that feeds the assembler; the trailer may come only once every chunk is recorded."""
        self._expect("chunks", "a chunk")
        try:
            spec = self._check_address(chunk)
            ledger = self._ledgers.setdefault((chunk.field, chunk.layer),
                                              LayerLedger(spec.layer_nbytes))
            ledger.claim(chunk.offset, len(chunk.data),
                         f"chunk of field {chunk.field!r} layer {chunk.layer}")
        except BaseException as err:
            self._fail(err)

    def land_chunk(self, chunk: ChunkPart, crc: int | None = None) -> int:
        """Write a claimed chunk's bytes into the reservation; returns their CRC-32C (``crc``
        when the caller computed it from the message). Safe on any thread, concurrently with
        other chunks' landing; ABORTED once the handoff was closed. Raising here does not close
        the assembler: the feeding thread gets the error and calls ``abort``."""
        reservation = self._reservation
        if reservation is None or self._state != "chunks":
            raise HandoffError("ABORTED", "the handoff was closed while its chunks landed")
        if crc is None:
            crc = crc32c(chunk.data)
        reservation.write(chunk.field, chunk.layer, chunk.offset, chunk.data)
        return crc

    def record_chunk(self, chunk: ChunkPart, crc: int) -> None:
        """A claimed chunk has landed with CRC-32C ``crc``."""
        self._expect("chunks", "a landed chunk")
        self._ledgers[(chunk.field, chunk.layer)].record(chunk.offset, crc)
        self.bytes_received += len(chunk.data)

    def on_trailer(self, trailer: TrailerPart) -> None:
        """Check that every byte arrived and every field's checksum matches (else DATA_LOSS)."""
        self._expect("chunks", "the trailer")
        try:
            manifest = self._header.manifest
            if trailer.first_token is None:
                raise HandoffError("INVALID_ARGUMENT", "trailer lacks the first token")
            try:
                check_asked(trailer.first_logprobs, self._header.spec.sampling.logprobs)
            except ValueError as exc:
                raise HandoffError("INVALID_ARGUMENT", f"trailer: {exc}") from None
            copied = self._copies.fields if self._copies is not None else set()
            banded = set(BANDED_FIELDS) if self._bands is not None else set()
            streamed = set(manifest) - copied - banded - self._declined
            if set(trailer.checksums) != streamed | (self._bands or set()):
                raise HandoffError("INVALID_ARGUMENT", f"trailer has checksums for "
                                   f"{sorted(trailer.checksums)}, the fields sent as bytes are "
                                   f"{sorted(streamed | (self._bands or set()))}")
            for name in copied:
                self._copies.check_complete(name)
            received = fold_checksums({n: spec for n, spec in manifest.items() if n in streamed},
                                      self._ledgers)
            for name, crc in received.items():
                if crc != trailer.checksums[name]:
                    raise HandoffError("DATA_LOSS", f"field {name!r}: crc32c {crc:#010x} of the "
                                       f"bytes received, trailer says "
                                       f"{trailer.checksums[name]:#010x}")
        except BaseException as err:
            self._fail(err)
        self.first_token = trailer.first_token
        self.first_logprobs = trailer.first_logprobs
        self._state = "verified"

    def on_end(self) -> Reservation:
        """The sender closed its stream: commit the verified reservation and hand it over.

        DATA_LOSS (releasing) if the trailer never came; ABORTED if the handoff was closed.
        """
        if self._state == "done":
            raise HandoffError("INVALID_ARGUMENT", "the handoff has already ended")
        if self._state == "closed":
            raise HandoffError("ABORTED", "handoff stream ended after the handoff was closed")
        if self._state != "verified":
            what = "before the trailer" if self._header else "without a header"
            self._fail(HandoffError("DATA_LOSS" if self._header else "INVALID_ARGUMENT",
                                    f"handoff stream ended {what}"))
        try:
            self._reservation.commit()
        except BaseException as err:
            self._fail(err)
        reservation, self._reservation = self._reservation, None
        self._state = "done"
        return reservation

    def abort(self) -> None:
        """Give up (cancellation, peer error): release what is held. Idempotent; no-op when done."""
        if self._state != "done":
            self._state = "closed"
            self._release()

    # internals
    def _expect(self, state: str, what: str) -> None:
        if self._state == state:
            return
        if self._state == "closed":
            raise HandoffError("ABORTED", f"{what} arrived after the handoff was closed")
        if self._state == "done":  # the reservation is the caller's now: leave it alone
            raise HandoffError("INVALID_ARGUMENT", f"{what} arrived after the handoff ended")
        expecting = {"header": "the header", "chunks": "chunks or the trailer",
                     "verified": "the end of the stream"}[self._state]
        self._fail(HandoffError("INVALID_ARGUMENT",
                                f"{what} arrived out of sequence (expecting {expecting})"))

    def _fail(self, err: BaseException) -> None:
        self._state = "closed"
        self._release()
        raise err

    def _release(self) -> None:
        reservation, self._reservation = self._reservation, None
        if reservation is not None:
            reservation.release()

    def _check_address(self, chunk: ChunkPart):
        """The chunk's field spec, once its field, layer and byte range are in bounds."""
        spec = self._header.manifest.get(chunk.field)
        where = f"chunk of field {chunk.field!r} layer {chunk.layer}"
        if self._copies is not None and chunk.field in self._copies.fields:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: the field arrives as pool copies")
        if self._bands is not None and chunk.field in BANDED_FIELDS:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: the field arrives on per-rank "
                               "streams")
        if spec is None:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: field not declared in the manifest")
        if chunk.field in self._declined:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: the receiver declined the field")
        if not 0 <= chunk.layer < spec.num_layers:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: layer out of range "
                               f"[0, {spec.num_layers})")
        end = chunk.offset + len(chunk.data)
        if not chunk.data or chunk.offset < 0 or end > spec.layer_nbytes:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: bytes [{chunk.offset}, {end}) are "
                               f"empty or outside the layer's {spec.layer_nbytes} bytes")
        return spec


def assemble_payload(parts: Iterable[HandoffPart], *, max_bytes: int = 1 << 62,
                     expected_layout: LayoutDescriptor | None = None,
                     expected_fingerprint: str | None = None) -> HandoffPayload:
    """Receive ``parts`` in memory and rebuild the payload (tests and same-process handoffs).

    Without an expected layout or fingerprint, the header's own are trusted.
    """
    it = iter(parts)
    first = next(it, None)
    if not isinstance(first, HeaderPart):
        raise HandoffError("INVALID_ARGUMENT", "a handoff must start with its header")
    reservations: list[InMemoryReservation] = []

    def reserve(header: HeaderPart) -> Reservation:
        reservations.append(InMemoryReservation(header.manifest))
        return reservations[-1]

    assembler = HandoffAssembler(expected_layout or first.layout,
                                 expected_fingerprint or first.fingerprint, max_bytes, reserve)
    assembler.on_header(first)
    try:
        for part in it:
            assembler.on_part(part)
        assembler.on_end()
    finally:
        assembler.abort()
    return HandoffPayload(handoff_id=first.handoff_id, fingerprint=first.fingerprint,
                          layout=first.layout, spec=first.spec,
                          first_token=assembler.first_token, fields=reservations[0].tensors,
                          first_logprobs=assembler.first_logprobs)
