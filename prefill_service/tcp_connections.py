"""The prefill worker's TCP connections to decode workers' handoff listeners (``tcp`` transport).

A handoff that the receiver offered TCP takes connections to that listener for its lifetime
(one handoff per connection at a time, so concurrent handoffs run on connections of their
own), spreads its chunks over them as frames (``common/handoff/tcp_frames.py``), each written
by the connection's own thread, and gives the connections back after its last chunk. A connection is opened with a hello carrying
the cluster's internal token and kept for the next handoff; one that failed is closed.

Sending runs on blocking sockets: ``sendmsg`` releases the GIL while the kernel copies, so the
event loop and the engine thread run meanwhile. A frame is written from its parts as they lie
(``Frame``: the chunk's encoded prefix, then a view of its payload in the sender's pinned host
buffer), in one ``sendmsg``; the buffer goes back once the kernel has taken its bytes. Over
TLS (``common/handoff/tcp_tls.py``) each part is written with ``sendall`` instead (an SSL
socket has no ``sendmsg``), encrypted where it lies, with the GIL released likewise.
"""

from __future__ import annotations

import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common.handoff.tcp_frames import OK, frame_header, hello


@dataclass(eq=False)
class Frame:
    """One chunk message to write, as the buffers it is made of (written in order, never
    joined), and what to call once it is written or dropped (``release``: gives a payload's
    host buffer back; called exactly once)."""

    parts: tuple
    release: Callable[[], None] | None = None

    @classmethod
    def of(cls, message: bytes) -> Frame:
        """A frame of one encoded message."""
        return cls((message,))

    @property
    def nbytes(self) -> int:
        return sum(memoryview(part).nbytes for part in self.parts)

    def done(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()


class TcpConnection:
    """One connection to a listener, used by one handoff at a time, with a writer thread of its
    own: :meth:`submit` queues a frame (at most ``max_queued`` wait), :meth:`flush` waits until
    every queued frame is written. A handoff spreads its chunks over several connections, so
    the kernel's copies run on several threads at once."""

    def __init__(self, sock: socket.socket, peer: tuple[str, int], max_queued: int = 4) -> None:
        self._sock = sock
        self.peer = peer
        self.broken = False
        self._error: OSError | None = None
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._closed = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="handoff-tcp-writer")
        self._writer.start()

    def submit(self, ticket: bytes, frame: Frame | bytes) -> None:
        """Queue one frame (or one encoded message) for the writer thread (blocks while
        ``max_queued`` wait). Raises the OSError of an earlier write that failed; the frame is
        released then, as every frame that is dropped."""
        if not isinstance(frame, Frame):
            frame = Frame.of(frame)
        while True:
            if self._error is not None or self._closed.is_set():
                frame.done()
                raise self._error or ConnectionAbortedError("the connection is closed")
            try:
                self._queue.put((ticket, frame), timeout=0.5)
                return
            except queue.Full:
                continue

    def flush(self) -> None:
        """Wait until every submitted frame is written; raises the OSError of one that was
        not."""
        self._queue.join()
        if self._error is not None:
            raise self._error

    def _write_loop(self) -> None:
        while not self._closed.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:  # close()'s wake-up
                self._queue.task_done()
                continue
            ticket, frame = item
            try:
                if self._error is None:
                    self._send(ticket, frame)
            except OSError as exc:
                self._error = exc  # later frames are dropped; submit and flush raise it
            finally:
                frame.done()
                self._queue.task_done()
        while True:  # closed: what is still queued is never written
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._queue.task_done()
                continue
            _, frame = item
            frame.done()
            self._error = self._error or ConnectionAbortedError("the connection is closed")
            self._queue.task_done()

    def _send(self, ticket: bytes, frame: Frame) -> None:
        """Write one frame: the header, then its parts, in as few ``sendmsg`` calls as the
        kernel allows. Marks the connection broken and raises OSError when a write fails."""
        views = [memoryview(frame_header(ticket, frame.nbytes))]
        views += [memoryview(part).cast("B") for part in frame.parts]
        try:
            if isinstance(self._sock, ssl.SSLSocket):
                for view in views:
                    self._sock.sendall(view)
                return
            while views:
                sent = self._sock.sendmsg(views)
                while views and sent >= views[0].nbytes:  # drop what went, keep the rest
                    sent -= views[0].nbytes
                    views.pop(0)
                if views and sent:
                    views[0] = views[0][sent:]
        except OSError:
            self.broken = True
            raise

    def alive(self) -> bool:
        """Whether an idle connection is still open at the other end (the listener never
        writes after its hello, so anything readable is its close)."""
        try:
            self._sock.setblocking(False)
            try:
                if isinstance(self._sock, ssl.SSLSocket):
                    # no peeking through TLS; a read that finds nothing raises, and reading
                    # what a listener never sends ends the connection anyway
                    self._sock.recv(1)
                else:
                    self._sock.recv(1, socket.MSG_PEEK)
                return False  # end of stream, or bytes a listener never sends
            finally:
                self._sock.setblocking(True)
        except (BlockingIOError, ssl.SSLWantReadError):
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Close at once; a thread blocked writing on it gets an OSError (shutdown wakes it,
        a plain close would not)."""
        self.broken = True
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:  # an idle writer waits on the queue: wake it, so that it ends now
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # a busy one sees the close at its next frame

    def join(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the writer thread to end after :meth:`close`."""
        self._writer.join(timeout_s)


def send_chunks(connections: list[TcpConnection], ticket: bytes,
                messages: Iterable[Frame | bytes],
                stopped: threading.Event | None = None) -> tuple[int, int]:
    """Write ``messages`` (frames, or encoded chunks, of the handoff ``ticket``) spread over
    ``connections``, and wait until every one is written, so that the trailer may follow.
    Blocking: call it on a sender thread. Returns ``(bytes, frames)``; stops with
    ConnectionAbortedError at the next chunk once ``stopped`` is set (the handoff ended), and
    raises the OSError of a write that failed. Every frame taken is released, sent or not."""
    sent = frames = 0
    try:
        for message in messages:
            frame = message if isinstance(message, Frame) else Frame.of(message)
            if stopped is not None and stopped.is_set():
                frame.done()
                raise ConnectionAbortedError("the handoff ended")
            nbytes = frame.nbytes
            connections[frames % len(connections)].submit(ticket, frame)
            sent += nbytes
            frames += 1
    finally:
        close = getattr(messages, "close", None)
        if close is not None:  # a generator of frames: it gives back what it still holds
            close()
    for connection in connections:
        connection.flush()
    return sent, frames


class TcpConnections:
    """Idle connections per listener address, opened on demand.

    Args:
        token: the cluster's internal token (None: a cluster without one).
        connect_timeout_s: how long opening a connection, its TLS handshake and its hello
            may take.
        max_idle: connections kept per listener once their handoffs are done.
        ssl_context: TLS on every connection (``tcp_tls.client_context``), the listener's
            certificate checked against the host dialled; None: plaintext.
    """

    def __init__(self, token: str | None, connect_timeout_s: float = 5.0,
                 max_idle: int = 4, retry_after_s: float = 30.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._hello = hello(token)
        self._ssl = ssl_context
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        # a listener that could not be reached is not tried again for this long: under
        # ``auto`` every handoff to it would wait out a connect timeout first
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[TcpConnection]] = {}
        self._failed: dict[tuple[str, int], tuple[float, str]] = {}
        self._closed = False

    def acquire(self, host: str, port: int) -> TcpConnection:
        """An idle connection to ``host:port``, or a new one (blocking: call it on a thread).
        Raises OSError when the listener cannot be reached or refuses the token."""
        peer = (host, port)
        with self._lock:
            if self._closed:
                raise OSError("the sender is closed")
            idle = self._idle.get(peer, [])
            while idle:
                connection = idle.pop()
                if connection.alive():
                    return connection
                connection.close()  # the listener went away meanwhile (a restart)
            failed = self._failed.get(peer)
            if failed is not None and time.monotonic() < failed[0] + self.retry_after_s:
                raise ConnectionError(f"{host}:{port} failed {failed[1]} (not retried for "
                                      f"{self.retry_after_s:.0f} s)")
        try:
            sock = socket.create_connection(peer, timeout=self.connect_timeout_s)
        except OSError as exc:
            self._remember_failure(peer, exc)
            raise
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=host)
            sock.sendall(self._hello)
            if sock.recv(1) != OK:
                raise ConnectionRefusedError(f"the handoff listener at {host}:{port} refused "
                                             "this worker (another internal token?)")
            sock.settimeout(None)  # a frame may wait on a slow receiver: its handoff decides
        except BaseException as exc:
            sock.close()
            if isinstance(exc, OSError):
                self._remember_failure(peer, exc)
            raise
        with self._lock:
            self._failed.pop(peer, None)
        return TcpConnection(sock, peer)

    def _remember_failure(self, peer: tuple[str, int], exc: OSError) -> None:
        with self._lock:
            self._failed[peer] = (time.monotonic(), f"{time.strftime('%H:%M:%S')}: {exc}")

    def release(self, connection: TcpConnection) -> None:
        """Give ``connection`` back after a handoff: kept for the next one unless broken."""
        with self._lock:
            idle = self._idle.setdefault(connection.peer, [])
            if not connection.broken and not self._closed and len(idle) < self.max_idle:
                idle.append(connection)
                return
        connection.close()

    def close(self, join_timeout_s: float = 1.0) -> None:
        """Close every idle connection and wait (up to ``join_timeout_s`` in all) for their
        writer threads to end: a daemon thread still running when the interpreter exits can
        abort the process."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        closed = [c for connections in idle.values() for c in connections]
        for connection in closed:
            connection.close()
        deadline = time.monotonic() + join_timeout_s
        for connection in closed:
            connection.join(max(0.0, deadline - time.monotonic()))
