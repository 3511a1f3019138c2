"""The handoff transports a worker may take (``--handoff-transport``), and what each implies.

- ``stream``: the state's bytes travel in the ``Decode.Handoff`` gRPC stream (works anywhere);
- ``tcp``: control on that stream, the bytes on a plain TCP connection to the decode worker's
  handoff listener (``common/handoff/tcp_frames.py``), past gRPC's own copies;
- ``device``: same host, the decode worker copies out of the prefill worker's pools (CUDA IPC,
  or shared memory on the CPU);
- ``auto``: ``device`` where both ends can, else ``tcp`` where the listener is reachable and
  TLS is off, else ``stream``.

docs/protocol.md, "Transports", has the whole rule set.
"""

from __future__ import annotations

HANDOFF_TRANSPORTS = ("auto", "stream", "tcp", "device")


def shares_pools(transport: str) -> bool:
    """Whether a worker with this transport offers (prefill) or opens (decode) pool memory on
    its host: the ``device`` path."""
    return transport in ("auto", "device")


def takes_tcp(transport: str) -> bool:
    """Whether a worker with this transport sends (prefill) or listens for (decode) chunks on
    a TCP connection beside the gRPC stream."""
    return transport in ("auto", "tcp")


def takes_tcp_with(transport: str, tls: object | None) -> bool:
    """Whether a worker with this transport and these TLS settings (None: plaintext) sends or
    listens for chunks over TCP: the frames are plaintext, so never beside TLS, and ``tcp``
    itself with TLS is a caller mistake (ValueError)."""
    if transport == "tcp" and tls is not None:
        raise ValueError("--handoff-transport tcp sends the state in plaintext: it cannot be "
                         "used with TLS (use auto, which then streams, or stream)")
    return takes_tcp(transport) and tls is None
