"""The decode worker's listener for the ``tcp`` transport: chunk frames beside ``Decode.Handoff``.

Each accepted handoff that takes its bytes over TCP gets a :class:`TcpOffer` (a random ticket
and an inbox on the event loop) and tells the sender the listener's port and the ticket in
``HandoffAccepted``. A thread per connection checks the hello's internal token, then reads
frames (``common/handoff/tcp_frames.py``): each frame's bytes are read into one ``bytes`` object
with the GIL released, and put into the inbox of the handoff its ticket names, where the
handoff's handler lands them like chunks from the stream (``decode_service/tcp_feed.py``).

At most ``max_ahead`` frames of one connection wait in inboxes at a time: a handler that lands
slowly holds its connection's reader, and TCP's own flow control holds the sender. Frames for
a ticket nobody holds (the handoff failed or was aborted) are read and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
from collections.abc import Callable

from common.handoff.tcp_frames import (FRAME_HEADER_BYTES, OK, TICKET_BYTES, FrameError,
                                       parse_frame_header, read_hello)

log = logging.getLogger(__name__)

_READ_BUFFER = 1 << 16  # a frame larger than this is read straight into its own bytes
_DROP_PIECE = 1 << 20


class TcpOffer:
    """One handoff's place on the listener. ``inbox`` (event loop) receives
    ``(message, release)`` for each frame, ``release`` to be called once it is taken, or a
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
    def post(self, item, release: Callable[[], None] | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, item, release)
        except RuntimeError:  # the loop is closed: the worker is stopping
            if release is not None:
                release()

    # event loop
    def _deliver(self, item, release) -> None:
        if self.closed:
            if release is not None:
                release()
            return
        self.inbox.put_nowait(item if release is None else (item, release))

    def withdraw(self) -> None:
        """No more frames for this handoff: later ones are dropped, queued ones released."""
        if self.closed:
            return
        self.closed = True
        self._listener.forget(self.ticket)
        while not self.inbox.empty():
            item = self.inbox.get_nowait()
            if isinstance(item, tuple):
                item[1]()


class TcpHandoffListener:
    """A listening socket and its reader threads.

    Args:
        host, port: where to listen (port 0: a free one, read back from ``port``).
        accepts: whether a hello's token is let in (``ServerSecurity.accepts``).
        max_ahead: frames of one connection waiting to land at most.
    """

    def __init__(self, host: str, port: int, accepts: Callable[[str | None], bool],
                 max_ahead: int = 8, max_connections: int = 256,
                 hello_timeout_s: float = 5.0) -> None:
        if max_ahead < 1:
            raise ValueError(f"max_ahead must be >= 1, got {max_ahead}")
        self._accepts = accepts
        self._max_ahead = max_ahead
        # a connection holds a thread: bound how many, and how long one may stay silent
        # before its hello
        self._max_connections = max_connections
        self._hello_timeout_s = hello_timeout_s
        self._lock = threading.Lock()
        self._offers: dict[bytes, TcpOffer] = {}
        self._connections: set[socket.socket] = set()
        self._closed = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
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

    def forget(self, ticket: bytes) -> None:
        with self._lock:
            self._offers.pop(ticket, None)

    def close(self) -> None:
        """Stop accepting and end every connection (their reader threads then exit)."""
        self._closed.set()
        with self._lock:
            connections = list(self._connections)
        for sock in [self._sock, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = len(self._connections) >= self._max_connections
                if not full:
                    self._connections.add(sock)
            if full:
                log.warning("handoff connection from %s refused: %d connections are open",
                            peer, self._max_connections)
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                             name="handoff-tcp-reader").start()

    def _serve(self, sock: socket.socket, peer) -> None:
        reader = sock.makefile("rb", buffering=_READ_BUFFER)
        carried: set[bytes] = set()  # tickets this connection brought frames for
        try:
            sock.settimeout(self._hello_timeout_s)
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
                message = reader.read(nbytes)
                if len(message) != nbytes:
                    room.release()
                    raise FrameError("connection closed inside a frame")
                offer.post(message, room.release)
        except (OSError, FrameError, ValueError) as exc:
            if not self._closed.is_set():
                log.warning("handoff connection from %s broke: %s", peer, exc)
                for ticket in carried:
                    with self._lock:
                        offer = self._offers.get(ticket)
                    if offer is not None:
                        offer.post(f"the TCP connection carrying its chunks broke: {exc}", None)
        finally:
            with self._lock:
                self._connections.discard(sock)
            reader.close()
            sock.close()


def _drop(reader, nbytes: int) -> None:
    while nbytes > 0:
        piece = reader.read(min(nbytes, _DROP_PIECE))
        if not piece:
            raise FrameError("connection closed inside a frame")
        nbytes -= len(piece)
