"""One prefill rank's half of per-rank handoff streams: its own heads of a request's state,
read out of its own pools and written as ``tcp`` frames straight to the decode ranks that hold
those heads (docs/protocol.md, "Per-rank streams").

Every rank of a tensor-parallel prefill worker has one (rank 0 in its handoff's sender, a
follower in its loop). Its work runs on one thread of its own, in the order it is given: the
engine thread (or a follower's loop) hands over what a step made final and goes on at once.
Pages and the slot of a held request are not written again until it is released, so reading
them while later forwards run is safe. Each band's bytes are recorded once in its layer's
checksum ledger however many decode ranks it goes to; ``finish`` flushes the connections and
returns the frames each decode rank was sent and each band's CRC-32C, which rank 0 puts in the
trailer (``prefill_service/leader_bands.py``).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from common.config import ModelConfig
from common.handoff.bands import Band
from common.handoff.ledger import LayerLedger, fold_checksums
from common.handoff.manifest import FieldSpec
from common.parallel.band_pools import band_page_bytes, read_kv_band, read_state_band
from common.parallel.rank_streams import RankStreamPlan, bands_from, held_ranges, local_start
from prefill_service.state_reader import FRAME_PAYLOAD_BYTES, frame_layer
from prefill_service.tcp_connections import TcpConnection, TcpConnections

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BandsSent:
    """What one prefill rank sent of one handoff: frames per decode rank (index = rank),
    each band's CRC-32C by its wire name, payload bytes; ``error`` when a write failed (the
    decode worker went away: the handoff cannot complete)."""

    frames: tuple[int, ...]
    checksums: dict[str, int]
    nbytes: int
    error: str | None = None


@dataclass
class _Outgoing:
    plan: RankStreamPlan
    bands: dict[Band, tuple[int, ...]]
    ledgers: dict[tuple[str, int], LayerLedger] = field(default_factory=dict)
    connections: dict[int, TcpConnection] = field(default_factory=dict)
    frames: list[int] = field(default_factory=list)
    nbytes: int = 0
    error: str | None = None
    stopped: threading.Event = field(default_factory=threading.Event)


class BandSender:
    """Sends rank ``rank``'s bands of handoffs from pools ``kv``, ``conv``, ``ssm`` (this
    rank's shards) of a model with ``config``."""

    def __init__(self, config: ModelConfig, rank: int, kv: torch.Tensor, conv: torch.Tensor,
                 ssm: torch.Tensor, ssl_context: ssl.SSLContext | None = None) -> None:
        """``ssl_context``: TLS on the connections to the decode ranks (the worker's, as for
        its gRPC channels: ``common/handoff/tcp_tls.py``); None: plaintext."""
        self.config, self.rank = config, rank
        self._ssl = ssl_context
        self._kv, self._conv, self._ssm = kv, conv, ssm
        self._tcp: TcpConnections | None = None
        self._handoffs: dict[int, _Outgoing] = {}  # only touched on the sender's thread
        self._dropped: set[int] = set()  # handoffs dropped from another thread
        self._lock = threading.Lock()
        # one torch thread: its gathers are copies, and a team of its own would take cores
        # from the forward
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="band-sender",
                                          initializer=torch.set_num_threads, initargs=(1,))

    # --- any thread ---
    def send(self, handoff_id: int, plan: RankStreamPlan, page_ids: list[int], start: int,
             slot: int | None, wait: Callable[[], None] | None = None) -> Future:
        """Queue pages ``page_ids`` (the prompt's pages ``start`` on) and, with ``slot``, the
        GDN state; ``wait`` runs first on the sender's thread (until the step that wrote them
        is over). A future of None; failures are kept for ``finish``."""
        return self._thread.submit(self._send, handoff_id, plan, list(page_ids), start, slot,
                                   wait)

    def finish(self, handoff_id: int) -> Future:
        """A future of :class:`BandsSent` once everything queued before it is written."""
        return self._thread.submit(self._finish, handoff_id)

    def drop(self, handoff_id: int) -> None:
        """The handoff ended early: stop its writes (queued ones are skipped) and forget it."""
        with self._lock:
            self._dropped.add(handoff_id)
        self._thread.submit(self._forget, handoff_id)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self._tcp is not None:
            self._tcp.close()

    # --- the sender's thread ---
    def _outgoing(self, handoff_id: int, plan: RankStreamPlan) -> _Outgoing:
        out = self._handoffs.get(handoff_id)
        if out is None:
            out = self._handoffs[handoff_id] = _Outgoing(
                plan, bands_from(self.config, plan.src_tp, plan.dst_tp, self.rank),
                frames=[0] * plan.dst_tp)
            if self._tcp is None:
                self._tcp = TcpConnections(plan.token, ssl_context=self._ssl)
        return out

    def _send(self, handoff_id: int, plan: RankStreamPlan, page_ids: list[int], start: int,
              slot: int | None, wait: Callable[[], None] | None) -> None:
        out = self._outgoing(handoff_id, plan)
        if wait is not None:
            wait()
        try:
            for band, dsts in out.bands.items():
                if self._is_dropped(handoff_id) or out.error is not None:
                    return
                if band.field == "kv" and page_ids:
                    self._send_kv(out, band, dsts, page_ids, start)
                elif band.field != "kv" and slot is not None:
                    self._send_state(out, band, dsts, slot)
        except OSError as exc:
            out.error = f"decode rank unreachable: {exc}"
            log.warning("handoff %016x: rank %d's stream failed: %s", handoff_id, self.rank, exc)
            self._close(out)

    def _send_kv(self, out: _Outgoing, band: Band, dsts, page_ids: list[int],
                 start: int) -> None:
        plan = out.plan
        at = local_start(held_ranges(self.config, self.rank, plan.src_tp)["kv"], band)
        index = torch.tensor(page_ids, dtype=torch.int64, device=self._kv.device)
        end = start + len(page_ids)
        tail = plan.num_pages * plan.page_size - plan.prompt_len if end == plan.num_pages else 0
        page_bytes = band_page_bytes(self._kv, band)
        for layer in range(self._kv.shape[0]):
            host = read_kv_band(self._kv, layer, index, at, band, tail).cpu()
            halves = host.reshape(2, -1).view(torch.uint8).numpy()
            for half in (0, 1):
                offset = (half * plan.num_pages + start) * page_bytes
                self._write(out, band, layer, offset, memoryview(halves[half]), dsts)

    def _send_state(self, out: _Outgoing, band: Band, dsts, slot: int) -> None:
        pool = self._pool(band)
        at = local_start(held_ranges(self.config, self.rank, out.plan.src_tp)[band.field], band)
        for layer in range(pool.shape[0]):
            host = read_state_band(pool, layer, slot, at, band).cpu()
            self._write(out, band, layer, 0, memoryview(host.reshape(-1).view(torch.uint8)
                                                        .numpy()), dsts)

    def _write(self, out: _Outgoing, band: Band, layer: int, offset: int, data: memoryview,
               dsts) -> None:
        key = (band.name, layer)
        if key not in out.ledgers:
            out.ledgers[key] = LayerLedger(self._layer_nbytes(out.plan, band))
        # one frame object per run, written to each decode rank that holds the band
        for frame in frame_layer(band.name, layer, offset, data, out.ledgers,
                                 FRAME_PAYLOAD_BYTES):
            for dst in dsts:
                connection = out.connections.get(dst)
                if connection is None:
                    connection = out.connections[dst] = self._tcp.acquire(
                        out.plan.host, out.plan.ports[dst])
                connection.submit(out.plan.ticket, frame)
                out.frames[dst] += 1
            out.nbytes += frame.nbytes - len(frame.parts[0])

    def _pool(self, band: Band) -> torch.Tensor:
        return {"kv": self._kv, "conv_state": self._conv, "ssm_state": self._ssm}[band.field]

    def _num_layers(self, band: Band) -> int:
        return self._pool(band).shape[0]

    def _layer_nbytes(self, plan: RankStreamPlan, band: Band) -> int:
        if band.field == "kv":
            return 2 * plan.num_pages * band_page_bytes(self._kv, band)
        pool = self._pool(band)
        return pool[0, 0].narrow(0, 0, band.width).numel() * pool.element_size()

    def _finish(self, handoff_id: int) -> BandsSent:
        out = self._handoffs.pop(handoff_id, None)
        if out is None:
            return BandsSent((), {}, 0, "nothing was sent (the handoff was dropped)")
        try:
            for connection in out.connections.values():
                connection.flush()
        except OSError as exc:
            out.error = out.error or f"decode rank unreachable: {exc}"
        if out.error is not None:
            self._close(out)
            return BandsSent(tuple(out.frames), {}, out.nbytes, out.error)
        for connection in out.connections.values():
            self._tcp.release(connection)
        specs = {band.name: FieldSpec("uint8", (self._num_layers(band),
                                               self._layer_nbytes(out.plan, band)))
                 for band in out.bands}
        checksums = fold_checksums(specs, out.ledgers)
        return BandsSent(tuple(out.frames), checksums, out.nbytes)

    def _forget(self, handoff_id: int) -> None:
        out = self._handoffs.pop(handoff_id, None)
        if out is not None:
            self._close(out)
        with self._lock:
            self._dropped.discard(handoff_id)

    def _is_dropped(self, handoff_id: int) -> bool:
        with self._lock:
            return handoff_id in self._dropped

    @staticmethod
    def _close(out: _Outgoing) -> None:
        connections, out.connections = out.connections, {}
        for connection in connections.values():
            connection.close()
