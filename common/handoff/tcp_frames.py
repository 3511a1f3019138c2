"""The ``tcp`` transport's connection format: a hello, then chunk frames, sender to receiver.

gRPC's Python layer copies every received message three times and tops out near 2 GB/s on one
stream (docs/protocol.md, "Transport rates"), under the rate the handoff must reach. So the
bulk bytes may travel on a plain TCP connection beside the ``Decode.Handoff`` call, which keeps
everything else: header, acceptance, trailer, checksums, acknowledgement and every refusal. The
sender writes each frame from its parts where they lie (the chunk's prefix, then a view of its
pinned host buffer); the receiver reads each frame straight into a reusable host buffer
(``readinto``) and lands it exactly as it lands a chunk that came on the stream.

A connection (opened by the sender, reused for handoff after handoff):

- hello, sender → receiver: ``b"FSH1"``, the length of the cluster's internal token (uint32,
  little-endian), the token (UTF-8; empty on a cluster without one); the receiver answers one
  byte, ``OK``, or closes the connection (a wrong token);
- then frames, sender → receiver only: ``b"FSC1"``, 4 zero bytes, the handoff's 16-byte ticket
  (from ``HandoffAccepted.tcp_ticket``), the length of what follows (uint64), then a serialized
  ``HandoffMessage`` holding one chunk (``common/handoff/chunk_codec.py``), at most
  ``MAX_FRAME_BYTES``.

A frame whose ticket names no live handoff (it failed or was aborted while the frame was on
the way) is read and dropped; a malformed frame ends the connection.
"""

from __future__ import annotations

import struct

HELLO_MAGIC = b"FSH1"
FRAME_MAGIC = b"FSC1"
OK = b"\x01"
TICKET_BYTES = 16
MAX_TOKEN_BYTES = 4096
MAX_FRAME_BYTES = 64 << 20
_HELLO = struct.Struct("<4sI")
_FRAME = struct.Struct("<4sI16sQ")
FRAME_HEADER_BYTES = _FRAME.size


class FrameError(Exception):
    """The peer broke the connection format (the connection is closed)."""


def hello(token: str | None) -> bytes:
    """The hello a sender writes first, carrying ``token`` (None: the cluster has none)."""
    raw = (token or "").encode("utf-8")
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"internal token longer than {MAX_TOKEN_BYTES} bytes")
    return _HELLO.pack(HELLO_MAGIC, len(raw)) + raw


def read_hello(read) -> str | None:
    """The token of a hello read with ``read(n)`` (a ``BufferedReader.read``); None when
    empty. Raises FrameError for anything that is not a hello."""
    head = read(_HELLO.size)
    if len(head) != _HELLO.size:
        raise FrameError("connection closed before its hello")
    magic, length = _HELLO.unpack(head)
    if magic != HELLO_MAGIC or length > MAX_TOKEN_BYTES:
        raise FrameError("not a flashsplit handoff connection")
    raw = read(length)
    if len(raw) != length:
        raise FrameError("connection closed inside its hello")
    try:
        return raw.decode("utf-8") or None
    except UnicodeDecodeError:
        raise FrameError("the hello's token is not UTF-8") from None


def frame_header(ticket: bytes, nbytes: int) -> bytes:
    """The 32 bytes before a frame of ``nbytes`` for the handoff ``ticket``."""
    if len(ticket) != TICKET_BYTES:
        raise ValueError(f"a ticket is {TICKET_BYTES} bytes, got {len(ticket)}")
    if not 0 < nbytes <= MAX_FRAME_BYTES:
        raise ValueError(f"a frame carries 1..{MAX_FRAME_BYTES} bytes, got {nbytes}")
    return _FRAME.pack(FRAME_MAGIC, 0, ticket, nbytes)


def parse_frame_header(head: bytes) -> tuple[bytes, int]:
    """``(ticket, nbytes)`` of a frame header; FrameError when malformed."""
    if len(head) != _FRAME.size:
        raise FrameError("connection closed inside a frame header")
    magic, reserved, ticket, nbytes = _FRAME.unpack(head)
    if magic != FRAME_MAGIC or reserved != 0:
        raise FrameError("not a handoff frame")
    if not 0 < nbytes <= MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {nbytes} bytes (1..{MAX_FRAME_BYTES} allowed)")
    return ticket, nbytes


def tcp_host(address: str) -> str | None:
    """The host of a gRPC target such as ``127.0.0.1:5001``, ``[::1]:5001``,
    ``dns:///decode-0.decode:5001`` or ``ipv4:10.0.0.3:5001``: where the receiver's handoff
    listener is; None for a target with no TCP host (``unix:``)."""
    target = address
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    else:
        if ":" in target.split("]")[0] and target.split(":", 1)[0] in ("unix", "unix-abstract",
                                                                        "vsock"):
            return None
    if "," in target:  # a list of addresses (ipv4:a:1,b:2): the first is the one dialled
        target = target.split(",", 1)[0]
    if target.startswith("["):
        end = target.find("]")
        return target[1:end] if end > 1 else None
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return host or None
