"""The handoff transports a worker may take (``--handoff-transport``), and what each implies.

- ``stream``: the state's bytes travel in the ``Decode.Handoff`` gRPC stream (works anywhere);
- ``tcp``: control on that stream, the bytes on a TCP connection to the decode worker's
  handoff listener (``common/handoff/tcp_frames.py``), past gRPC's own copies; TLS on it when
  the workers use TLS (``common/handoff/tcp_tls.py``);
- ``device``: same host, the decode worker copies out of the prefill worker's pools (CUDA IPC,
  or shared memory on the CPU);
- ``auto``: ``device`` where both ends can, else ``tcp`` where the listener is reachable, else
  ``stream``.

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

