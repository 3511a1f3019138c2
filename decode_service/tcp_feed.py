"""One handoff's chunks that arrive over TCP, taken from its offer's inbox and landed.

A task on the event loop takes each frame from the :class:`TcpOffer`, reads it as a chunk in
place (``chunk_codec.decode_chunk``) and hands it to the handoff's :class:`ChunkLandings`, the
same claim → checksum and copy on a writer thread → record path as chunks from the stream, so
every validation rule holds unchanged. The chunk lands from the frame's host buffer (its
payload as a slice of the buffer's tensor, pinned on a GPU worker), and the buffer goes back to
the listener's pool once the chunk has landed; a frame that is dropped instead (refused, or the
handoff failed) gives its buffer back at once. The handler waits for the trailer's
``tcp_chunks`` with :meth:`TcpFeed.wait_for` before it checks the trailer.

After a refused chunk the feed keeps taking (and dropping) frames: the sender is mid-payload
and must not block on a full connection; the refusal is raised at the trailer, as a refusal in
the middle of a stream is answered after its rest has been read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from common.handoff.chunk_codec import decode_chunk
from common.handoff.errors import HandoffError
from common.handoff.parts import ChunkPart
from decode_service.chunk_landings import ChunkLandings
from decode_service.tcp_listener import TcpFrame, TcpOffer


class TcpFeed:
    """Lands the frames of ``offer`` through ``landings``; started by :meth:`start`."""

    def __init__(self, offer: TcpOffer, landings: ChunkLandings) -> None:
        self.offer = offer
        self._landings = landings
        self.taken = 0  # frames taken from the inbox (landed or dropped)
        self.active = False  # a frame was taken: the stream may carry no chunk of its own
        self.error: HandoffError | None = None
        self.last_frame: float | None = None  # time.monotonic() of the latest frame taken
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def refuse(self, error: HandoffError) -> None:
        """Drop every frame from now on, and raise ``error`` at the trailer."""
        self.error = self.error or error

    async def _run(self) -> None:
        while True:
            item = await self.offer.inbox.get()
            if isinstance(item, str):  # a connection that carried our frames broke
                self.refuse(HandoffError("DATA_LOSS", item))
                self._changed.set()
                continue
            frame: TcpFrame = item
            frame.take()  # its connection's reader may read the next frame
            self.active = True
            self.last_frame = time.monotonic()
            if self.error is not None:
                frame.release()  # dropped: the sender is mid-payload, the refusal is kept
            else:
                try:
                    await self._land(frame)
                except HandoffError as exc:
                    self.refuse(exc)
                except Exception as exc:  # noqa: BLE001 - a bug: fail this handoff only
                    self.refuse(HandoffError("INTERNAL",
                                             f"landing a TCP chunk failed: {exc!r}"))
            self.taken += 1
            self._changed.set()

    async def _land(self, frame: TcpFrame) -> None:
        """Start landing ``frame``'s chunk, giving its buffer back exactly once: here when it
        is not one chunk, from the call to ``add`` on by the landings (after the landing, or
        when they refuse it), whatever is raised, cancellation included."""
        try:
            raw = decode_chunk(frame.data)
            if raw is None or raw.data_start + len(raw.data) != len(frame.data):
                raise HandoffError("INVALID_ARGUMENT",
                                   "a TCP frame that is not exactly one chunk")
            chunk = ChunkPart(field=raw.field, layer=raw.layer, offset=raw.offset, data=raw.data)
            # the payload as a slice of the buffer's own tensor: torch knows it is pinned
            source = frame.host[raw.data_start:raw.data_start + len(raw.data)]
        except BaseException:
            frame.release()
            raise
        await self._landings.add(chunk, frame.data, raw, source=source, done=frame.release)

    async def wait_for(self, count: int, timeout_s: float) -> None:
        """Until ``count`` frames were taken (the trailer's ``tcp_chunks``), then stop taking.
        Raises the feed's refusal, DATA_LOSS when its connection broke, DEADLINE_EXCEEDED
        when no frame came for ``timeout_s``, INVALID_ARGUMENT when more came than ``count``."""
        while self.taken < count and self.error is None:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                raise HandoffError("DEADLINE_EXCEEDED", f"{count - self.taken} of the "
                                   f"trailer's {count} TCP chunks did not come in {timeout_s} "
                                   "s") from None
        await self.stop()
        if self.error is not None:
            raise self.error
        if self.taken != count:
            raise HandoffError("INVALID_ARGUMENT", f"the trailer says {count} TCP chunks, "
                               f"{self.taken} came")

    async def stop(self) -> None:
        """Stop taking frames (a landing already started keeps running: ``settle`` or
        ``drain`` the landings after this)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None
