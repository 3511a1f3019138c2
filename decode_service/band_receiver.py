"""One decode rank's half of per-rank handoff streams: the bands of its own heads, arriving as
``tcp`` frames from the prefill ranks that own them, landed straight into its own pools
(docs/protocol.md, "Per-rank streams").

Every rank of a tensor-parallel decode worker has one, over a handoff listener of its own
(rank 0's is the worker's ``--handoff-port`` listener). Rank 0 tells each rank what to expect
when it reserves room for a handoff (``expect``: the ticket, the reserved pages and slot, the
sender's parallel size), and how many frames were sent once the trailer came (``complete``).
Each frame is checked as a chunk from the stream is (its band one this rank holds, its layer,
its byte range inside the band's layer, no overlap with bytes received before), landed on the
connection's reader thread and its CRC-32C recorded; ``complete`` then folds every band's
CRC-32C and says what is missing. Rank 0 compares those with the trailer's before it admits.
A frame for a ticket no longer expected is read and dropped by the listener.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from common.config import ModelConfig
from common.handoff.bands import Band
from common.handoff.chunk_codec import decode_chunk
from common.handoff.errors import HandoffError
from common.handoff.ledger import LayerLedger, fold_checksums, message_payload_crc
from common.handoff.manifest import FieldSpec
from common.parallel.band_pools import band_page_bytes, write_kv_band, write_state_band
from common.parallel.rank_streams import bands_to, held_ranges, local_start
from decode_service.tcp_listener import TcpFrame, TcpHandoffListener


@dataclass(frozen=True)
class BandsLanded:
    """What one decode rank received of one handoff: each band's CRC-32C by its wire name and
    the payload bytes, or the refusal (``code``: a gRPC status name, and its message)."""

    checksums: dict[str, int]
    nbytes: int
    code: str | None = None
    message: str = ""

    def raise_error(self, rank: int) -> None:
        if self.code is not None:
            raise HandoffError(self.code, f"decode rank {rank}: {self.message}")


@dataclass
class _Expected:
    band: Band
    spec: FieldSpec  # the band's shape and dtype (``num_layers``, ``layer_nbytes``)
    at: int  # where it starts in this rank's pool


@dataclass
class _Inbox:
    ticket: bytes
    page_ids: list[int]
    slot: int
    num_pages: int
    expected: dict[str, _Expected]
    ledgers: dict[tuple[str, int], LayerLedger] = field(default_factory=dict)
    taken: int = 0
    nbytes: int = 0
    writers: int = 0
    error: HandoffError | None = None
    closed: bool = False
    last_frame: float = field(default_factory=time.monotonic)


class BandReceiver:
    """Lands this rank's bands (pools ``kv``, ``conv``, ``ssm``: rank ``rank`` of
    ``world_size``'s shards of a model with ``config``) from frames ``listener`` reads."""

    def __init__(self, listener: TcpHandoffListener, config: ModelConfig, rank: int,
                 world_size: int, kv: torch.Tensor, conv: torch.Tensor,
                 ssm: torch.Tensor) -> None:
        self.listener = listener
        self.config, self.rank, self.world_size = config, rank, world_size
        self._kv, self._conv, self._ssm = kv, conv, ssm
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._inboxes: dict[bytes, _Inbox] = {}

    @property
    def port(self) -> int:
        return self.listener.port

    def expect(self, ticket: bytes, page_ids: list[int], slot: int, prompt_len: int,
               page_size: int, src_tp: int) -> None:
        """Take frames of ``ticket``: the bands this rank holds of a prompt of ``prompt_len``
        from a prefill worker of ``src_tp`` ranks, landing in ``page_ids`` and ``slot``."""
        num_pages = -(-prompt_len // page_size)
        held = held_ranges(self.config, self.rank, self.world_size)
        expected = {}
        for band in bands_to(self.config, src_tp, self.world_size, self.rank):
            spec = self._spec(band, num_pages)
            expected[band.name] = _Expected(band, spec, local_start(held[band.field], band))
        inbox = _Inbox(ticket, list(page_ids), slot, num_pages, expected)
        with self._lock:
            self._inboxes[ticket] = inbox
        self.listener.register(_Offer(self, inbox))

    def _spec(self, band: Band, num_pages: int) -> FieldSpec:
        if band.field == "kv":
            return FieldSpec("uint8", (self._kv.shape[0],
                                       2 * num_pages * band_page_bytes(self._kv, band)))
        pool = self._conv if band.field == "conv_state" else self._ssm
        row = pool[0, 0, 0].numel() * pool.element_size()
        return FieldSpec("uint8", (pool.shape[0], band.width * row))

    def complete(self, ticket: bytes, frames: int, idle_timeout_s: float) -> BandsLanded:
        """Wait until ``frames`` frames of ``ticket`` were taken (or one failed, or none came
        for ``idle_timeout_s``), stop taking them, and say what landed."""
        with self._lock:
            inbox = self._inboxes.get(ticket)
            if inbox is None:
                return BandsLanded({}, 0, "ABORTED", "the handoff is not expected here")
            while inbox.taken < frames and inbox.error is None and not inbox.closed:
                if time.monotonic() - inbox.last_frame >= idle_timeout_s:
                    inbox.error = HandoffError(
                        "DEADLINE_EXCEEDED", f"{frames - inbox.taken} of {frames} frames did "
                        f"not come in {idle_timeout_s} s")
                    break
                self._changed.wait(0.2)
            self._changed.wait_for(lambda: not inbox.writers)
        self.forget(ticket)
        try:
            if inbox.error is not None:
                raise inbox.error
            if inbox.taken != frames:
                raise HandoffError("INVALID_ARGUMENT", f"the trailer says {frames} frames, "
                                   f"{inbox.taken} came")
            specs = {name: e.spec for name, e in inbox.expected.items()}
            return BandsLanded(fold_checksums(specs, inbox.ledgers), inbox.nbytes)
        except HandoffError as exc:
            return BandsLanded({}, inbox.nbytes, exc.code, exc.message)

    def forget(self, ticket: bytes) -> None:
        """No more frames of ``ticket`` land (later ones are dropped); returns once none is
        landing, so its pages and slot may go to another request."""
        self.listener.forget(ticket)
        with self._lock:
            inbox = self._inboxes.pop(ticket, None)
            if inbox is not None:
                inbox.closed = True
                self._changed.wait_for(lambda: not inbox.writers)
                self._changed.notify_all()

    # --- listener reader threads ---
    def post(self, inbox: _Inbox, item: TcpFrame | str) -> None:
        if isinstance(item, str):  # a connection that carried its frames broke
            with self._lock:
                inbox.error = inbox.error or HandoffError("DATA_LOSS", item)
                self._changed.notify_all()
            return
        try:
            with self._lock:
                if inbox.closed:
                    return
                inbox.taken += 1
                inbox.last_frame = time.monotonic()
                if inbox.error is not None:
                    return  # dropped: the sender is mid-payload, the refusal is kept
                claimed = self._claim(inbox, item)
                inbox.writers += 1
            try:
                self._land(inbox, item, *claimed)
            finally:
                with self._lock:
                    inbox.writers -= 1
        except HandoffError as exc:
            with self._lock:
                inbox.error = inbox.error or exc
        except Exception as exc:  # noqa: BLE001 - a bug: fail this handoff only
            with self._lock:
                inbox.error = inbox.error or HandoffError("INTERNAL", f"landing failed: {exc!r}")
        finally:
            item.release()
            with self._lock:
                self._changed.notify_all()

    def _claim(self, inbox: _Inbox, frame: TcpFrame):
        """Check a frame's chunk against what this rank expects and claim its bytes."""
        raw = decode_chunk(frame.data)
        if raw is None or raw.data_start + len(raw.data) != len(frame.data):
            raise HandoffError("INVALID_ARGUMENT", "a TCP frame that is not exactly one chunk")
        where = f"decode rank {self.rank}: chunk of {raw.field!r} layer {raw.layer}"
        expected = inbox.expected.get(raw.field)
        if expected is None:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: not a band this rank holds "
                               f"({sorted(inbox.expected)})")
        spec = expected.spec
        if not 0 <= raw.layer < spec.num_layers:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: layer out of range "
                               f"[0, {spec.num_layers})")
        end = raw.offset + len(raw.data)
        if not raw.data or end > spec.layer_nbytes:
            raise HandoffError("INVALID_ARGUMENT", f"{where}: bytes [{raw.offset}, {end}) are "
                               f"empty or outside the band's {spec.layer_nbytes} bytes")
        ledger = inbox.ledgers.setdefault((raw.field, raw.layer), LayerLedger(spec.layer_nbytes))
        ledger.claim(raw.offset, len(raw.data), where)
        return raw, expected

    def _land(self, inbox: _Inbox, frame: TcpFrame, raw, expected: _Expected) -> None:
        source = frame.host[raw.data_start:raw.data_start + len(raw.data)]
        band = expected.band
        if band.field == "kv":
            write_kv_band(self._kv, raw.layer, inbox.page_ids, inbox.num_pages, expected.at,
                          band, raw.offset, source)
        else:
            pool = self._conv if band.field == "conv_state" else self._ssm
            write_state_band(pool, raw.layer, inbox.slot, expected.at, band, raw.offset, source)
        if source.device.type == "cpu" and self._kv.device.type == "cuda":
            torch.cuda.current_stream(self._kv.device).synchronize()  # the frame is reused next
        crc = message_payload_crc(frame.data, raw.data_start)
        with self._lock:
            inbox.ledgers[(raw.field, raw.layer)].record(raw.offset, crc)
            inbox.nbytes += len(raw.data)


class _Offer:
    """An inbox as the listener sees it: a ticket, and where its reader threads post."""

    def __init__(self, receiver: BandReceiver, inbox: _Inbox) -> None:
        self.ticket = inbox.ticket
        self._receiver, self._inbox = receiver, inbox

    def post(self, item: TcpFrame | str) -> None:
        self._receiver.post(self._inbox, item)
