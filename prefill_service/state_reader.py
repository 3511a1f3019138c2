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

Payload layouts (``common/handoff/manifest.py``): ``kv`` and ``dflash_context`` are
``[L, 2, pages, page, kv_heads, head_dim]`` (K of every page, then V), so pages ``[a, b)`` of
one layer are two byte ranges: ``[a, b)`` and ``[N + a, N + b)`` pages in, ``N`` being the
prompt's page count.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from common.handoff.host_buffers import HostBuffer, HostBufferPool, HostBufferPoolConfig
from common.handoff.ledger import LayerLedger, message_payload_crc
from common.handoff.manifest import FieldSpec
from common.handoff.chunk_codec import encode_chunk
from prefill_service.engine import StateReady


@dataclass(frozen=True)
class PromptShape:
    """The prompt a handoff carries: its length and the page size of the pools."""

    prompt_len: int
    page_size: int

    @property
    def num_pages(self) -> int:
        return -(-self.prompt_len // self.page_size)


class StateReader:
    """Encodes pool contents as chunks of at most ``chunk_bytes``, recording each in the
    caller's checksum ledgers (``fold_checksums`` turns them into the trailer's CRCs).

    The state is read a piece at a time (one layer, or a run of its pages of at most
    ``piece_bytes``): on a GPU each piece is copied on the reader's stream into a buffer of
    ``host_buffers`` (pinned, reused) while the piece before it is encoded, and each waits only
    for the layer that wrote it when the step reports its progress (``StateReady.layer_ready``).
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
            # two pieces in flight per reader thread, and two reader threads
            host_buffers = HostBufferPool(HostBufferPoolConfig(4 * piece_bytes, pin_memory=True))
        self.host_buffers = host_buffers if on_gpu else None

    def read(self, ready: StateReady, page_ranges: list[tuple[str, int, int]], states: bool,
             prompt: PromptShape,
             ledgers: dict[tuple[str, int], LayerLedger]) -> Iterator[bytes]:
        """Chunks of ``page_ranges`` (``(field, start page, end page)``) and, with ``states``,
        of the GDN conv and recurrent state, in the order the forward writes them: each piece
        after the model layer that wrote it, the draft's context (written after the whole
        forward) last. So within a prompt's last chunk each GDN layer's state goes while the
        later layers run, instead of after the last attention layer's KV, and only the last
        layer's data is left when the forward ends."""
        pieces = [p for name, start, end in page_ranges
                  for p in self._page_pieces(ready, name, start, end, prompt)]
        if states:
            pieces += self._state_pieces(ready)
        pieces.sort(key=self._written_at)  # stable: a layer's pieces keep their order
        for piece, host in self._to_host(pieces, ready):
            yield from self._encode(piece, host, prompt, ledgers)

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
            for layer in range(pool.shape[0]):
                wait = self._layer_wait(ready, name, layer)
                for a in range(0, len(ids), per_piece):
                    piece_ids = ids[a:a + per_piece]
                    piece_tail = tail if a + len(piece_ids) == len(ids) else 0
                    pieces.append(_Piece(
                        name, layer, wait, (start + a, page_bytes),
                        lambda pool=pool, layer=layer, piece_ids=piece_ids, t=piece_tail:
                            _gather(pool, layer, piece_ids, t)))
        return pieces

    def _state_pieces(self, ready: StateReady) -> list[_Piece]:
        conv, ssm, slot = self._conv, self._ssm, ready.slot
        if ready.gathered is not None:
            conv, ssm, slot = ready.gathered.conv, ready.gathered.ssm, 0
        return [_Piece(name, layer, self._layer_wait(ready, name, layer), None,
                       lambda pool=pool, layer=layer: pool[layer, slot])
                for name, pool in (("conv_state", conv), ("ssm_state", ssm))
                for layer in range(pool.shape[0])]

    def _encode(self, piece: _Piece, host, prompt: PromptShape,
                ledgers: dict[tuple[str, int], LayerLedger]) -> Iterator[bytes]:
        if piece.where is None:  # a layer of a GDN state: its bytes from offset 0
            yield from encode_layer(piece.field, piece.layer, 0, memoryview(host.reshape(-1)),
                                    ledgers, self.chunk_bytes)
            return
        first, page_bytes = piece.where  # pages: K's bytes, then V's, of this run of pages
        halves = host.reshape(2, -1)
        for half in (0, 1):
            offset = (half * prompt.num_pages + first) * page_bytes
            yield from encode_layer(piece.field, piece.layer, offset,
                                    memoryview(halves[half]), ledgers, self.chunk_bytes)

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

    def _to_host(self, pieces: list[_Piece], ready: StateReady):
        """``(piece, uint8 ndarray of its bytes)`` in order. On a GPU the copy of the next
        piece runs while the caller encodes this one; a buffer goes back to the pool once the
        caller has encoded it (the chunks are copies)."""
        if self._stream is None:
            for piece in pieces:
                piece.wait()  # the CPU: the layer has run once it is queued
                yield piece, _host_bytes(piece.gather().contiguous())
            return
        in_flight: collections.deque = collections.deque()
        current = None
        try:
            for i, piece in enumerate(pieces):
                in_flight.append(self._start_copy(piece))
                if len(in_flight) < 2 and i + 1 < len(pieces):
                    continue  # keep one copy running ahead of the one being encoded
                current = in_flight.popleft()
                yield self._finish_copy(current)
                current.release()
                current = None
            while in_flight:
                current = in_flight.popleft()
                yield self._finish_copy(current)
                current.release()
                current = None
        finally:  # the caller stopped early: let the copies land, then give the buffers back
            for copy in ([current] if current is not None else []) + list(in_flight):
                copy.done.synchronize()
                copy.release()

    def _start_copy(self, piece: _Piece) -> _Copy:
        event = piece.wait()  # blocks until the layer is queued
        with torch.cuda.stream(self._stream):
            if event is not None:
                self._stream.wait_event(event)
            device = piece.gather().contiguous()
            nbytes = device.numel() * device.element_size()
            # never waits: when the pool is short (another reader holds it), torch's caching
            # pinned allocator serves instead
            buffer = (self.host_buffers.try_acquire(nbytes)
                      if nbytes <= self.host_buffers.capacity_bytes else None)
            host = (buffer.tensor if buffer is not None
                    else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
            host.copy_(device.reshape(-1).view(torch.uint8), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return _Copy(piece, device, host, buffer, done)

    @staticmethod
    def _finish_copy(copy: _Copy):
        copy.done.synchronize()
        try:
            return copy.piece, copy.host.numpy()
        finally:
            copy.device = None  # the copy is done: the device memory may be reused

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
    gather: Callable[[], torch.Tensor]


@dataclass
class _Copy:
    piece: _Piece
    device: torch.Tensor | None
    host: torch.Tensor
    buffer: HostBuffer | None
    done: torch.cuda.Event

    def release(self) -> None:
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None


def _host_bytes(tensor: torch.Tensor):
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _gather(pool: torch.Tensor, layer: int, page_ids: list[int], tail: int) -> torch.Tensor:
    """Pages ``page_ids`` of one layer of ``[L, pool_pages, 2, page, ...]`` as
    ``[2, n, page, ...]``; the last ``tail`` token rows of the last page (stale bytes of an
    earlier owner) zeroed."""
    index = torch.tensor(page_ids, device=pool.device)
    out = pool[layer, index].transpose(0, 1).contiguous()
    if tail:
        out[:, -1, out.shape[2] - tail:] = 0
    return out


def new_ledgers(manifest: dict[str, FieldSpec]) -> dict[tuple[str, int], LayerLedger]:
    """An empty checksum ledger for every layer of every field of ``manifest``."""
    return {(name, layer): LayerLedger(spec.layer_nbytes)
            for name, spec in manifest.items() for layer in range(spec.num_layers)}


def fold_checksums(manifest: dict[str, FieldSpec],
                   ledgers: dict[tuple[str, int], LayerLedger]) -> dict[str, int]:
    """The trailer's CRC of each field, from what was encoded (raises if bytes are missing)."""
    checksums = {}
    for name, spec in manifest.items():
        crc = 0
        for layer in range(spec.num_layers):
            crc = ledgers[(name, layer)].fold(crc, f"{name} layer {layer}")
        checksums[name] = crc
    return checksums


def encode_layer(name: str, layer: int, offset: int, data: memoryview,
                 ledgers: dict[tuple[str, int], LayerLedger], chunk_bytes: int) -> Iterator[bytes]:
    """``data`` (bytes ``offset..`` of one layer of ``name``) as encoded chunks of at most
    ``chunk_bytes``, each recorded in its layer's checksum ledger. Both the copy into the
    message and its CRC-32C run with the GIL released (``message_payload_crc``)."""
    ledger = ledgers[(name, layer)]
    for start in range(0, len(data), chunk_bytes):
        piece = data[start:start + chunk_bytes]
        message = encode_chunk(name, layer, offset + start, piece)
        ledger.claim(offset + start, len(piece), f"{name} layer {layer}")
        ledger.record(offset + start, message_payload_crc(message, len(message) - len(piece)))
        yield message
