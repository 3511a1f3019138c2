"""What a prefill worker and its send process say to each other over their socket pair.

Each message is a 4-byte big-endian length and a msgpack list whose first item names it. The
chunks' bytes never pass here: they sit in the shared slots, and a ``slot`` message names one.

Worker -> send process:
    ``["security", tls_or_None, metadata]`` (first, once): how to open channels;
    ``["open", call_id, address, method, timeout_s]``: start a stream-stream call;
    ``["write", call_id, message]``: write these bytes on it (headers, trailers, pool copies);
    ``["slot", call_id, slot, nbytes]``: write the first ``nbytes`` of that slot on it;
    ``["done", call_id]``: no more writes;
    ``["cancel", call_id]``: cancel it.

Send process -> worker:
    ``["reply", call_id, message]``: one message the receiver wrote back;
    ``["end", call_id, status_code, details]``: the call is over (its final status);
    ``["free", slot]``: the slot's bytes are written (or dropped): it may be filled again.
"""

from __future__ import annotations

import socket
import struct
import threading

import msgpack

_LENGTH = struct.Struct(">I")
MAX_WIRE_MESSAGE = 64 << 20  # a header of a large tensor-parallel manifest stays far below


class WireClosed(Exception):
    """The other end closed the socket (it exited, or asked to stop)."""


class Wire:
    """Length-prefixed msgpack messages on a blocking socket; ``send`` is safe from any
    thread, ``receive`` is for one reading thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, *message) -> None:
        body = msgpack.packb(list(message), use_bin_type=True)
        with self._send_lock:
            try:
                self.sock.sendall(_LENGTH.pack(len(body)) + body)
            except OSError as exc:
                raise WireClosed(str(exc)) from None

    def receive(self) -> list:
        (length,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        if length > MAX_WIRE_MESSAGE:
            raise WireClosed(f"a wire message of {length} bytes: the other end is broken")
        return msgpack.unpackb(self._exactly(length), raw=False)

    def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                read = self.sock.recv_into(view[got:])
            except OSError as exc:
                raise WireClosed(str(exc)) from None
            if read == 0:
                raise WireClosed("the other end closed the socket")
            got += read
        return buf

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
