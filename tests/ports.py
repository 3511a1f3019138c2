"""A loopback port nothing listens on, for tests of calls and connections that must fail."""

from __future__ import annotations

import socket


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed on leaving: nothing listens there now
