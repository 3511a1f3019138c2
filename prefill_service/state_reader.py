"""Reads the final parts of a held request's prompt state out of the prefill pools as encoded
handoff chunks, on a sender thread (never the engine thread).

Each piece is read once the layer that writes it has run: a report made before its step
(``StateReady.layer_ready``) says when each layer is queued, and this thread waits for that; on a
GPU the gather then runs on a stream of its own that waits for the layer's event (or the step's,
``StateReady.ready``) and lands in reused pinned host memory. Only this thread waits.
Pages and the slot of a held request are not written again until it is released, so reading
them while the engine runs other requests is safe.

A tensor-parallel worker's report carries the full model's state of what it made final,
gathered from every rank (``StateReady.gathered``: the pages from ``gathered_from`` on, and the
GDN state in the final report): it is read from that instead of the pools, which hold only this
rank's heads. The draft's pool is whole on rank 0 and is read as before.

Two outputs: ``read`` yields encoded chunk messages of at most ``chunk_bytes`` (the gRPC stream
takes ``bytes``); ``frames`` yields each run of bytes as one ``Frame`` whose payload is a view of
the pinned host buffer itself, checksummed in place, for the ``tcp`` transport to write with no
copy; the buffer goes back once every frame over it is written. On a GPU consecutive pieces
are copied as one batch of up to ``piece_bytes`` (one wait, one event, one buffer): every wait,
event and buffer is a round of GIL hand-offs with the engine thread, whose prefill is bound by
the host launching kernels.

Payload layouts (``common/handoff/manifest.py``): ``kv`` and ``dflash_context`` are
``[L, 2, pages, page, kv_heads, head_dim]`` (K of every page, then V), so pages ``[a, b)`` of
one layer are two byte ranges: ``[a, b)`` and ``[N + a, N + b)`` pages in, ``N`` being the
prompt's page count.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from common.handoff.chunk_codec import chunk_prefix, encode_chunk
from common.handoff.host_buffers import HostBuffer, HostBufferPool, HostBufferPoolConfig
from common.handoff.ledger import LayerLedger
from common.handoff.tcp_frames import MAX_FRAME_BYTES
from prefill_service.engine import StateReady
from prefill_service.tcp_connections import Frame

# a frame's payload, leaving room for the chunk's prefix under the frame limit
FRAME_PAYLOAD_BYTES = MAX_FRAME_BYTES - 64


@dataclass(frozen=True)
class PromptShape:
    """The prompt a handoff carries: its length and the page size of the pools."""

    prompt_len: int
    page_size: int

    @property
    def num_pages(self) -> int:
        return -(-self.prompt_len // self.page_size)


class StateReader:
    """Reads pool contents as encoded chunks of at most ``chunk_bytes`` (``read``) or as
    frames (``frames``), recording each in the caller's checksum ledgers (``fold_checksums``
    turns them into the trailer's CRCs).

    The state is read a piece at a time (one layer, or a run of its pages of at most
    ``piece_bytes``): on a GPU consecutive pieces of up to ``piece_bytes`` together are copied
    on the reader's stream into a buffer of ``host_buffers`` (pinned, reused) while the batch
    before it is taken, and each waits only for the layers that wrote it when the step reports
    its progress (``StateReady.layer_ready``).
    """

    def __init__(self, kv: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                 draft_kv: torch.Tensor | None, chunk_bytes: int, *,
                 piece_bytes: int = 16 << 20, host_buffers: HostBufferPool | None = None,
                 model_layers: ModelLayers | None = None) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
        self._kv, self._conv, self._ssm, self._draft_kv = kv, conv, ssm, draft_kv
        self.chunk_bytes = chunk_bytes
        self.piece_bytes = piece_bytes
        self.model_layers = model_layers
        on_gpu = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv.device) if on_gpu else None
        if on_gpu and host_buffers is None:
            # per reader thread two batches being copied and a few queued as frames on a
            # connection; two reader threads. Short of room, torch's pinned allocator serves.
            host_buffers = HostBufferPool(HostBufferPoolConfig(8 * piece_bytes, pin_memory=True))
        self.host_buffers = host_buffers if on_gpu else None

    def read(self, ready: StateReady, page_ranges: list[tuple[str, int, int]], states: bool,
             prompt: PromptShape,
             ledgers: dict[tuple[str, int], LayerLedger],
             encode: Callable = encode_chunk) -> Iterator:
        """Chunks of ``page_ranges`` (``(field, start page, end page)``) and, with ``states``,
        of the GDN conv and recurrent state, in the order the forward writes them: each piece
        after the model layer that wrote it, the draft's context (written after the whole
        forward) last. So within a prompt's last chunk each GDN layer's state goes while the
        later layers run, instead of after the last attention layer's KV, and only the last
        layer's data is left when the forward ends. ``encode(field, layer, offset, data)``
        makes each message (``encode_chunk``: a new ``bytes``)."""
        for piece, host, _ in self._to_host(self._pieces(ready, page_ranges, states, prompt)):
            for offset, data in self._byte_runs(piece, host, prompt):
                yield from encode_layer(piece.field, piece.layer, offset, data, ledgers,
                                        self.chunk_bytes, encode)

    def frames(self, ready: StateReady, page_ranges: list[tuple[str, int, int]], states: bool,
               prompt: PromptShape,
               ledgers: dict[tuple[str, int], LayerLedger]) -> Iterator[Frame]:
        """The same bytes as ``read``, in the same order, as frames: each run of a piece's
        bytes (a GDN layer's state; the K or the V of a run of pages) is one chunk of up to
        ``FRAME_PAYLOAD_BYTES``, its payload a view of the host buffer (no copy), its CRC-32C
        computed in place. The caller must ``done()`` every frame it takes (the TCP writer
        does, written or dropped): the buffer goes back to the pool after the last."""
        for piece, host, lease in self._to_host(self._pieces(ready, page_ranges, states,
                                                             prompt)):
            for offset, data in self._byte_runs(piece, host, prompt):
                yield from frame_layer(piece.field, piece.layer, offset, data, ledgers,
                                       FRAME_PAYLOAD_BYTES, lease.hold)

    def _pieces(self, ready: StateReady, page_ranges: list[tuple[str, int, int]], states: bool,
                prompt: PromptShape) -> list[_Piece]:
        pieces = [p for name, start, end in page_ranges
                  for p in self._page_pieces(ready, name, start, end, prompt)]
        if states:
            pieces += self._state_pieces(ready)
        pieces.sort(key=self._written_at)  # stable: a layer's pieces keep their order
        return pieces

    def _written_at(self, piece: _Piece) -> float:
        index = (None if self.model_layers is None
                 else self.model_layers.model_layer(piece.field, piece.layer))
        return float("inf") if index is None else index

    def _page_pieces(self, ready: StateReady, name: str, start: int, end: int,
                     prompt: PromptShape) -> list[_Piece]:
        if end <= start:
            return []
        ids = list(ready.page_ids[start:end])
        pool = self._kv if name == "kv" else self._draft_kv
        if name == "kv" and ready.gathered is not None:
            first = ready.gathered_from  # its pages are in order from there
            if start < first or end - first > ready.gathered.num_pages:
                raise ValueError(f"pages [{start}, {end}) are not all in the gathered "
                                 f"[{first}, {first + ready.gathered.num_pages})")
            pool, ids = ready.gathered.kv, list(range(start - first, end - first))
        last = end == prompt.num_pages
        tail = prompt.num_pages * prompt.page_size - prompt.prompt_len if last else 0
        pieces = []
        if pool is not None:
            page_bytes = pool[0, 0, 0].numel() * pool.element_size()
            per_piece = max(1, self.piece_bytes // (2 * page_bytes))
            index = _PageIndex(ids, pool.device, self._stream)  # made once, for every layer
            for layer in range(pool.shape[0]):
                wait = self._layer_wait(ready, name, layer)
                for a in range(0, len(ids), per_piece):
                    count = min(per_piece, len(ids) - a)
                    piece_tail = tail if a + count == len(ids) else 0
                    pieces.append(_Piece(
                        name, layer, wait, (start + a, page_bytes), 2 * count * page_bytes,
                        lambda pool=pool, layer=layer, a=a, count=count, t=piece_tail:
                            _gather(pool, layer, index.get()[a:a + count], t)))
        return pieces

    def _state_pieces(self, ready: StateReady) -> list[_Piece]:
        conv, ssm, slot = self._conv, self._ssm, ready.slot
        if ready.gathered is not None:
            conv, ssm, slot = ready.gathered.conv, ready.gathered.ssm, 0
        return [_Piece(name, layer, self._layer_wait(ready, name, layer), None,
                       pool[0, 0].numel() * pool.element_size(),
                       lambda pool=pool, layer=layer: pool[layer, slot])
                for name, pool in (("conv_state", conv), ("ssm_state", ssm))
                for layer in range(pool.shape[0])]

    @staticmethod
    def _byte_runs(piece: _Piece, host, prompt: PromptShape) -> Iterator[tuple[int, memoryview]]:
        """``(offset in its layer, bytes)`` of each contiguous run of the piece's bytes."""
        if piece.where is None:  # a layer of a GDN state: its bytes from offset 0
            yield 0, memoryview(host.reshape(-1))
            return
        first, page_bytes = piece.where  # pages: K's bytes, then V's, of this run of pages
        halves = host.reshape(2, -1)
        for half in (0, 1):
            yield (half * prompt.num_pages + first) * page_bytes, memoryview(halves[half])

    def _layer_wait(self, ready: StateReady, field: str, layer: int) -> Callable[[], object]:
        """What a read of ``layer`` of ``field`` waits for, as a call that returns the event
        for the reader's stream (None: nothing to wait for on the device): the model layer
        that wrote it, when the step reports its progress (the call blocks until that layer is
        queued), else the end of the step."""
        progress = ready.layer_ready
        if progress is None:
            return lambda: ready.ready
        index = None if self.model_layers is None else self.model_layers.model_layer(field, layer)
        if index is None:  # written after the forward (or not known): wait for all of it
            index = progress.num_layers - 1
        return lambda: progress.wait(index)

    def _to_host(self, pieces: list[_Piece]):
        """``(piece, uint8 ndarray of its bytes, lease of its buffer)`` in order. On a GPU the
        copy of the next batch runs while the caller takes this one; a batch's buffer goes back
        to the pool once the caller is past its pieces and every frame that holds it is done."""
        if self._stream is None:
            for piece in pieces:
                piece.wait()  # the CPU: the layer has run once it is queued
                yield piece, _host_bytes(piece.gather().contiguous()), _Lease(None)
            return
        batches = self._batches(pieces)
        in_flight: collections.deque = collections.deque()
        current = None
        try:
            for i, batch in enumerate(batches):
                in_flight.append(self._start_copy(batch))
                if len(in_flight) < 2 and i + 1 < len(batches):
                    continue  # keep one copy running ahead of the one being taken
                current = in_flight.popleft()
                yield from self._finish_copy(current)
                current.lease.drop()
                current = None
            while in_flight:
                current = in_flight.popleft()
                yield from self._finish_copy(current)
                current.lease.drop()
                current = None
        finally:  # the caller stopped early: let the copies land, then give the buffers back
            for copy in ([current] if current is not None else []) + list(in_flight):
                copy.done.synchronize()
                copy.lease.drop()

    def _batches(self, pieces: list[_Piece]) -> list[list[_Piece]]:
        """Consecutive pieces of up to ``piece_bytes`` together (a piece larger alone)."""
        batches: list[list[_Piece]] = []
        size = 0
        for piece in pieces:
            if batches and size + piece.nbytes <= self.piece_bytes:
                batches[-1].append(piece)
                size += piece.nbytes
            else:
                batches.append([piece])
                size = piece.nbytes
        return batches

    def _start_copy(self, batch: list[_Piece]) -> _Copy:
        # blocks until each layer is queued; pieces are in write order, so the batch's
        # events are those of its last layers
        events = list(dict.fromkeys(e for e in (p.wait() for p in batch) if e is not None))
        nbytes = sum(p.nbytes for p in batch)
        with torch.cuda.stream(self._stream):
            for event in events:
                self._stream.wait_event(event)
            # never waits: when the pool is short (another reader holds it), torch's caching
            # pinned allocator serves instead
            host, buffer = self.host_buffers.acquire_now(nbytes)
            devices, pos = [], 0
            for piece in batch:
                device = piece.gather().contiguous()
                host[pos:pos + piece.nbytes].copy_(device.reshape(-1).view(torch.uint8),
                                                   non_blocking=True)
                devices.append(device)
                pos += piece.nbytes
            done = torch.cuda.Event()
            done.record(self._stream)
        return _Copy(batch, devices, host, _Lease(buffer), done)

    @staticmethod
    def _finish_copy(copy: _Copy):
        copy.done.synchronize()
        copy.devices = []  # the copy is done: the device memory may be reused
        flat, pos = copy.host.numpy(), 0
        for piece in copy.batch:
            yield piece, flat[pos:pos + piece.nbytes], copy.lease
            pos += piece.nbytes

    def close(self) -> None:
        if self.host_buffers is not None:
            self.host_buffers.close()


@dataclass(frozen=True)
class ModelLayers:
    """Which model layer writes layer ``i`` of a handoff field: the ``i``-th full-attention
    layer for ``kv``, the ``i``-th GDN layer for ``conv_state`` and ``ssm_state``; None for
    ``dflash_context``, which the draft writes after the whole forward."""

    full_attention: tuple[int, ...]
    gdn: tuple[int, ...]

    def model_layer(self, field: str, layer: int) -> int | None:
        if field == "kv":
            return self.full_attention[layer]
        if field in ("conv_state", "ssm_state"):
            return self.gdn[layer]
        return None


@dataclass
class _Piece:
    field: str
    layer: int
    wait: Callable[[], object]  # blocks until it may be read; its event (GPU) or None
    where: tuple[int, int] | None  # (first page, page bytes) of a run of pages; None: a state
    nbytes: int
    gather: Callable[[], torch.Tensor]


class _PageIndex:
    """A run of page ids as a device index tensor, made on first use on the reader's stream
    (from pinned memory, so making it never waits for the engine's stream)."""

    def __init__(self, ids: list[int], device: torch.device, stream) -> None:
        self._ids, self._device, self._stream = ids, device, stream
        self._tensor: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self._tensor is None:
            host = torch.tensor(self._ids, dtype=torch.int64)
            if self._stream is not None:
                host = host.pin_memory()
            self._tensor = host.to(self._device, non_blocking=True)
        return self._tensor


class _Lease:
    """Who still needs one batch's host buffer: the reader while it yields the batch, and
    each frame whose payload is a view of it. The buffer goes back when the last lets go."""

    def __init__(self, buffer: HostBuffer | None) -> None:
        self._buffer = buffer
        self._holders = 1  # the reader
        self._lock = threading.Lock()

    def hold(self) -> Callable[[], None]:
        """Another holder; call what this returns once (a frame's ``release``)."""
        with self._lock:
            self._holders += 1
        return self.drop

    def drop(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last and self._buffer is not None:
            self._buffer.release()
            self._buffer = None


@dataclass
class _Copy:
    batch: list[_Piece]
    devices: list[torch.Tensor]
    host: torch.Tensor
    lease: _Lease
    done: torch.cuda.Event = field(repr=False)


def _host_bytes(tensor: torch.Tensor):
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _gather(pool: torch.Tensor, layer: int, index: torch.Tensor, tail: int) -> torch.Tensor:
    """Pages ``index`` (a device tensor of page ids) of one layer of
    ``[L, pool_pages, 2, page, ...]`` as ``[2, n, page, ...]``; the last ``tail`` token rows of
    the last page (stale bytes of an earlier owner) zeroed. Each half is gathered straight
    into its place (one pass over the bytes, where a gather then a transposing copy made two)."""
    src = pool[layer]
    out = torch.empty((2, index.numel(), *src.shape[2:]), dtype=src.dtype, device=src.device)
    for half in (0, 1):
        torch.index_select(src[:, half], 0, index, out=out[half])
    if tail:
        out[:, -1, out.shape[2] - tail:] = 0
    return out


def checked_runs(name: str, layer: int, offset: int, data: memoryview,
                 ledgers: dict[tuple[str, int], LayerLedger],
                 run_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """``(offset, bytes)`` of each run of at most ``run_bytes`` of ``data`` (bytes ``offset..``
    of one layer of ``name``), claimed in its layer's checksum ledger with its CRC-32C, read in
    place with the GIL released."""
    ledger = ledgers[(name, layer)]
    where = f"{name} layer {layer}"
    for start in range(0, len(data), run_bytes):
        piece = data[start:start + run_bytes]
        ledger.add(offset + start, piece, where)
        yield offset + start, piece


def encode_layer(name: str, layer: int, offset: int, data: memoryview,
                 ledgers: dict[tuple[str, int], LayerLedger], chunk_bytes: int,
                 encode: Callable = encode_chunk) -> Iterator:
    """``data`` (bytes ``offset..`` of one layer of ``name``) as encoded chunk messages of at
    most ``chunk_bytes`` (made by ``encode``), each recorded in its layer's checksum ledger."""
    for at, piece in checked_runs(name, layer, offset, data, ledgers, chunk_bytes):
        yield encode(name, layer, at, piece)


def frame_layer(name: str, layer: int, offset: int, data: memoryview,
                ledgers: dict[tuple[str, int], LayerLedger], frame_bytes: int,
                hold: Callable[[], Callable[[], None] | None] = lambda: None
                ) -> Iterator[Frame]:
    """``data`` as ``tcp`` frames of at most ``frame_bytes``, each recorded in its layer's
    checksum ledger: a frame is the chunk's prefix and a view of ``data`` (never copied), and
    its ``release`` is what ``hold()`` returns for it."""
    for at, piece in checked_runs(name, layer, offset, data, ledgers, frame_bytes):
        yield Frame((chunk_prefix(name, layer, at, len(piece)), piece), hold())
