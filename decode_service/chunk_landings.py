"""Chunks of one handoff landing on writer threads while the handler reads the next ones.

Each chunk is claimed on the event loop (its address checked, its byte range taken), then its
checksum and its copy into the pools run on a writer thread: CRC-32C over the chunk's payload,
read in place inside its message, and the copy both release the GIL, so up to
``max_in_flight`` chunks land while gRPC receives more. Results are recorded in arrival order;
the trailer is checked only once every chunk has landed (``drain``). Whatever happens,
``settle`` waits for writes still running, so no thread writes into room that is given back.

A ``device`` transport's pool copy runs the same way (``add_pool_copy``): claimed on the loop,
run on a writer thread while the next part is read, waited for before the trailer.

A chunk from the stream lands from its message's ``bytes``. A chunk that came over TCP lands
from its frame's host buffer (``source``, a uint8 tensor: pinned on a GPU worker, so its copy to
the device is a true asynchronous one), and ``done`` gives that buffer back once nothing reads
it any more: right after the landing (the write returns only once its copy has read the
source), or at once when the chunk is refused.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from common.handoff.chunk_codec import RawChunk
from common.handoff.ledger import message_payload_crc
from common.handoff.parts import ChunkPart, PoolCopyPart
from common.handoff.stream import HandoffAssembler


def _land(assembler: HandoffAssembler, chunk: ChunkPart, message: bytes | memoryview,
          raw: RawChunk | None, source: torch.Tensor | None) -> int:
    crc = None
    if raw is not None and raw.data_start + len(raw.data) == len(message):
        crc = message_payload_crc(message, raw.data_start)  # GIL released over the payload
    if source is not None:
        # the reservation lands the same bytes from the host tensor, which torch knows pinned
        chunk = dataclasses.replace(chunk, data=source)
    return assembler.land_chunk(chunk, crc)


class ChunkLandings:
    """The chunks of one handoff that are landing; one per handler, used on the event loop."""

    def __init__(self, assembler: HandoffAssembler, writer: Executor,
                 max_in_flight: int = 4) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self._assembler = assembler
        self._writer = writer
        self._max = max_in_flight
        self._pending: collections.deque = collections.deque()

    async def add(self, chunk: ChunkPart, message: bytes | memoryview, raw: RawChunk | None,
                  *, source: torch.Tensor | None = None,
                  done: Callable[[], None] | None = None) -> None:
        """Claim ``chunk`` and start landing it; waits while ``max_in_flight`` are landing.
        Raises the ``HandoffError`` of a refused or failed chunk.

        ``source``: the chunk's bytes (``chunk.data``'s) as a 1-D uint8 CPU tensor to land
        from. ``done`` is called exactly once, whatever happens (this raising or cancelled
        included), once the chunk's bytes are no longer read: on the writer thread after its
        landing, or here when it is refused before landing."""
        try:
            self._assembler.claim_chunk(chunk)
            landing = self._writer.submit(_land, self._assembler, chunk, message, raw, source)
        except BaseException:
            if done is not None:
                done()
            raise
        if done is not None:
            # runs on the writer thread as the landing ends (or where the future is cancelled,
            # if it never started), not on the event loop: the buffer is free at once
            landing.add_done_callback(lambda _: done())
        self._pending.append((chunk, asyncio.wrap_future(landing)))
        while len(self._pending) >= self._max:
            await self._record_oldest()

    async def add_pool_copy(self, part: PoolCopyPart) -> None:
        """Claim a ``device`` transport copy and start it on a writer thread, as a chunk: the
        next part is read while it runs (a GPU: the copy is queued on the reservation's
        stream), ``drain`` waits for it before the trailer, ``settle`` after a failure."""
        self._assembler.claim_pool_copy(part)
        copy = self._writer.submit(self._assembler.run_pool_copy, part)
        self._pending.append((None, asyncio.wrap_future(copy)))
        while len(self._pending) >= self._max:
            await self._record_oldest()

    async def drain(self) -> None:
        """Wait until every chunk (and copy) added so far has landed and is recorded."""
        while self._pending:
            await self._record_oldest()

    async def settle(self) -> None:
        """Wait for every landing still running, ignoring their outcome (the handoff failed)."""
        pending, self._pending = self._pending, collections.deque()
        for _, future in pending:
            try:
                await asyncio.shield(future)
            except BaseException:  # noqa: BLE001 - its handoff already failed
                pass

    async def _record_oldest(self) -> None:
        chunk, future = self._pending[0]
        crc = await asyncio.shield(future)
        self._pending.popleft()
        if chunk is not None:  # a pool copy has no bytes to record
            self._assembler.record_chunk(chunk, crc)
