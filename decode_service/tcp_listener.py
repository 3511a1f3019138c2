"""The decode worker's listener for the ``tcp`` transport: chunk frames beside ``Decode.Handoff``.

Each accepted handoff that takes its bytes over TCP gets a :class:`TcpOffer` (a random ticket
and an inbox on the event loop) and tells the sender the listener's port and the ticket in
``HandoffAccepted``. A thread per connection checks the hello's internal token, then reads
frames (``common/handoff/tcp_frames.py``) and puts each, as a :class:`TcpFrame`, into the inbox
of the handoff its ticket names, where the handoff's handler lands it like a chunk from the
stream (``decode_service/tcp_feed.py``).

A frame's message is read (``readinto``, the GIL released) straight into a reusable host
buffer of the listener's :class:`HostBufferPool`: pinned on a worker whose pools are on a GPU,
so the landing's copy to the device is a true asynchronous one from it, and plain memory on a
CPU worker, so no frame allocates and page-faults fresh memory. The buffer goes back to the
pool once the frame's chunk has landed (or the frame was dropped). When the pool has no room
right now (more frames in flight than it was sized for, or a frame larger than it) the frame
gets a freshly allocated buffer instead: a reader never waits for buffers, so it can never wait
on a landing that waits on it.

With TLS (``ssl_context``, ``common/handoff/tcp_tls.py``) each connection's handshake comes
first, under the hello's time limit, then the same hello and frames inside it.

At most ``max_ahead`` frames of one connection wait in inboxes at a time: a handler that lands
slowly holds its connection's reader, and TCP's own flow control holds the sender. Frames for
a ticket nobody holds (the handoff failed or was aborted) are read and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable

import torch

from common.handoff.host_buffers import HostBuffer, HostBufferPool, HostBufferPoolConfig
from common.handoff.tcp_frames import (FRAME_HEADER_BYTES, OK, TICKET_BYTES, FrameError,
                                       parse_frame_header, read_hello)

log = logging.getLogger(__name__)

_READ_BUFFER = 1 << 16  # a frame larger than this is read straight into its host buffer
_DROP_PIECE = 1 << 20
# frames as senders make them (4-16 MiB; tcp_frames.MAX_FRAME_BYTES is the most allowed)
_TYPICAL_FRAME_BYTES = 16 << 20
# frames of a connection that hold buffers besides the max_ahead waiting in inboxes: those
# taken and still landing (ChunkLandings lands up to 4 of a handoff at once)
_LANDING_FRAMES = 4
_CLOSE_WAIT_S = 2.0  # how long close waits for reader threads (one polls its room each 0.5 s)


class TcpFrame:
    """One frame's message in host memory, from the reader thread that read it to its landing.

    ``data`` is the message (a writable memoryview of exactly its bytes) and ``host`` the same
    bytes as a 1-D uint8 CPU tensor (pinned on a GPU worker). ``take`` (when the frame leaves
    its inbox) lets the connection's reader read ahead again; ``release`` gives the buffer
    back, and takes the frame if it was not taken: call it once nothing reads the bytes any
    more. Both are idempotent and may be called on any thread; the bytes must not be read after
    ``release`` (the next frame is read into them).
    """

    __slots__ = ("data", "host", "_buffer", "_room", "_lock")

    def __init__(self, host: torch.Tensor, buffer: HostBuffer | None,
                 room: threading.Semaphore | None) -> None:
        self.host = host
        self.data = memoryview(host.numpy())
        self._buffer = buffer  # None: a fresh allocation, freed with the frame
        self._room = room
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            room, self._room = self._room, None
        if room is not None:
            room.release()

    def release(self) -> None:
        self.take()
        with self._lock:
            buffer, self._buffer = self._buffer, None
        if buffer is not None:
            buffer.release()


class TcpOffer:
    """One handoff's place on the listener. ``inbox`` (event loop) receives a
    :class:`TcpFrame` for each frame, which its taker must ``take`` and ``release``, or a
    ``str`` saying why a connection that carried frames for it broke."""

    def __init__(self, listener: TcpHandoffListener, ticket: bytes,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.port = listener.port
        self.ticket = ticket
        self.inbox: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._listener = listener
        self.closed = False

    # reader threads
    def post(self, item: TcpFrame | str) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the loop is closed: the worker is stopping
            _release(item)

    # event loop
    def _deliver(self, item: TcpFrame | str) -> None:
        if self.closed:
            _release(item)
            return
        self.inbox.put_nowait(item)

    def withdraw(self) -> None:
        """No more frames for this handoff: later ones are dropped, queued ones released."""
        if self.closed:
            return
        self.closed = True
        self._listener.forget(self.ticket)
        while not self.inbox.empty():
            _release(self.inbox.get_nowait())


def _release(item: TcpFrame | str) -> None:
    if isinstance(item, TcpFrame):
        item.release()


class TcpHandoffListener:
    """A listening socket, its reader threads and the host buffers they read frames into.

    Args:
        host, port: where to listen (port 0: a free one, read back from ``port``).
        accepts: whether a hello's token is let in (``ServerSecurity.accepts``).
        max_ahead: frames of one connection waiting to land at most.
        pin_memory: page-lock the frames' buffers (a worker whose pools are on a GPU; needs
            CUDA, else ValueError).
        buffer_bytes: the pool of reusable frame buffers, allocated once (default: room for
            one busy connection's frames of 16 MiB, waiting and landing).
        ssl_context: TLS on every connection (``tcp_tls.server_context``); None: plaintext.
    """

    def __init__(self, host: str, port: int, accepts: Callable[[str | None], bool],
                 max_ahead: int = 8, max_connections: int = 256,
                 hello_timeout_s: float = 5.0, *, pin_memory: bool = False,
                 buffer_bytes: int | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        if max_ahead < 1:
            raise ValueError(f"max_ahead must be >= 1, got {max_ahead}")
        if buffer_bytes is None:
            buffer_bytes = (max_ahead + _LANDING_FRAMES) * _TYPICAL_FRAME_BYTES
        self._accepts = accepts
        self._ssl = ssl_context
        self.tls = ssl_context is not None
        self._max_ahead = max_ahead
        # a connection holds a thread: bound how many, and how long one may stay silent
        # before its hello
        self._max_connections = max_connections
        self._hello_timeout_s = hello_timeout_s
        self._lock = threading.Lock()
        self._offers: dict[bytes, TcpOffer] = {}
        self._connections: set[socket.socket] = set()
        self._readers: set[threading.Thread] = set()
        self._closed = threading.Event()
        self.fresh_buffers = 0  # frames that found the pool full and got a buffer of their own
        self.buffers = HostBufferPool(HostBufferPoolConfig(buffer_bytes, pin_memory=pin_memory))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            self.buffers.close()
            raise
        self.port = self._sock.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name="handoff-tcp-accept")
        self._acceptor.start()

    def offer(self, loop: asyncio.AbstractEventLoop) -> TcpOffer:
        """A new ticket for one handoff, whose frames go to the returned offer's inbox."""
        offer = TcpOffer(self, secrets.token_bytes(TICKET_BYTES), loop)
        with self._lock:
            self._offers[offer.ticket] = offer
        return offer

    def register(self, offer) -> None:
        """Frames of ``offer.ticket`` go to ``offer.post`` (called on reader threads, with a
        :class:`TcpFrame` to ``release`` or a ``str`` saying why a connection broke): another
        kind of offer than :meth:`offer`'s, such as a rank's band receiver."""
        with self._lock:
            self._offers[offer.ticket] = offer

    @property
    def num_connections(self) -> int:
        """Connections open now (each has a reader thread)."""
        with self._lock:
            return len(self._connections)

    def forget(self, ticket: bytes) -> None:
        with self._lock:
            self._offers.pop(ticket, None)

    def close(self) -> None:
        """Stop accepting, end every connection, wait (a little) for their reader threads to
        exit, then close the buffer pool. Frames still queued or landing keep their buffers
        until they are released, as ever."""
        with self._lock:
            self._closed.set()
            connections = list(self._connections)
        for sock in [self._sock, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        deadline = time.monotonic() + _CLOSE_WAIT_S
        self._acceptor.join(_CLOSE_WAIT_S)
        with self._lock:
            readers = list(self._readers)  # final: the acceptor starts no more
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        # a reader still running finds the pool closed and reads into its own buffer
        self.buffers.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                refused = self._closed.is_set() or len(self._connections) >= self._max_connections
                if not refused:
                    self._connections.add(sock)
                    reader = threading.Thread(target=self._serve, args=(sock, peer),
                                              daemon=True, name="handoff-tcp-reader")
                    self._readers.add(reader)
            if refused:
                if not self._closed.is_set():
                    log.warning("handoff connection from %s refused: %d connections are open",
                                peer, self._max_connections)
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader.start()

    def _serve(self, sock: socket.socket, peer) -> None:
        reader = None
        carried: set[bytes] = set()  # tickets this connection brought frames for
        try:
            sock.settimeout(self._hello_timeout_s)
            if self._ssl is not None:
                wrapped = self._handshake(sock, peer)
                if wrapped is None:
                    return
                sock = wrapped
            reader = sock.makefile("rb", buffering=_READ_BUFFER)
            if not self._accepts(read_hello(reader.read)):
                log.warning("handoff connection from %s refused: wrong internal token", peer)
                return
            sock.sendall(OK)
            sock.settimeout(None)  # between handoffs a connection may idle for hours
            room = threading.Semaphore(self._max_ahead)
            while not self._closed.is_set():
                head = reader.read(FRAME_HEADER_BYTES)
                if not head:
                    return  # the sender closed between frames
                ticket, nbytes = parse_frame_header(head)
                with self._lock:
                    offer = self._offers.get(ticket)
                if offer is None:
                    _drop(reader, nbytes)
                    continue
                carried.add(ticket)
                if len(carried) > 1024:  # a long-lived connection: keep the live ones only
                    with self._lock:
                        carried &= self._offers.keys()
                while not room.acquire(timeout=0.5):
                    if self._closed.is_set():
                        return
                offer.post(self._read_frame(reader, nbytes, room))
        except (OSError, FrameError, ValueError, RuntimeError, MemoryError) as exc:
            # RuntimeError, MemoryError: no memory for a frame's fresh buffer
            if not self._closed.is_set():
                log.warning("handoff connection from %s broke: %s", peer, exc)
                for ticket in carried:
                    with self._lock:
                        offer = self._offers.get(ticket)
                    if offer is not None:
                        offer.post(f"the TCP connection carrying its chunks broke: {exc}")
        finally:
            with self._lock:
                self._connections.discard(sock)
                self._readers.discard(threading.current_thread())
            if reader is not None:
                reader.close()
            sock.close()

    def _handshake(self, sock: socket.socket, peer) -> ssl.SSLSocket | None:
        """The TLS side of an accepted connection, or None when the handshake fails (logged
        as a refusal). The wrapped socket takes ``sock``'s place in the set that :meth:`close`
        shuts down."""
        try:
            wrapped = self._ssl.wrap_socket(sock, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            if not self._closed.is_set():
                log.warning("handoff connection from %s refused: TLS handshake failed: %s",
                            peer, exc)
            return None  # the caller's finally closes sock
        with self._lock:
            self._connections.discard(sock)
            self._connections.add(wrapped)
        return wrapped

    def _read_frame(self, reader, nbytes: int, room: threading.Semaphore) -> TcpFrame:
        """The next ``nbytes`` of the connection in a frame holding ``room`` (acquired); the
        room and the buffer are given back if the read fails."""
        try:
            frame = TcpFrame(*self._buffer(nbytes), room)
        except BaseException:
            room.release()
            raise
        try:
            _read_into(reader, frame.data)
        except BaseException:
            frame.release()
            raise
        return frame

    def _buffer(self, nbytes: int) -> tuple[torch.Tensor, HostBuffer | None]:
        """A host tensor of ``nbytes`` to read a frame into: a piece of the pool when it has
        room now, else a fresh allocation (never a wait: see the module's docstring)."""
        # a closed pool (the listener closing) gives fresh memory: a reader still running
        # reads its frame to the end
        host, buffer = self.buffers.acquire_now(nbytes, closed_ok=True)
        if buffer is None:
            with self._lock:
                self.fresh_buffers += 1
        return host, buffer


def _read_into(reader, view: memoryview) -> None:
    """Fill ``view`` from ``reader`` (a BufferedReader: a read this large goes straight into
    ``view`` past its own buffer); FrameError at an end of stream first."""
    got, nbytes = 0, len(view)
    while got < nbytes:
        n = reader.readinto(view[got:])
        if not n:
            raise FrameError("connection closed inside a frame")
        got += n


def _drop(reader, nbytes: int) -> None:
    while nbytes > 0:
        piece = reader.read(min(nbytes, _DROP_PIECE))
        if not piece:
            raise FrameError("connection closed inside a frame")
        nbytes -= len(piece)
