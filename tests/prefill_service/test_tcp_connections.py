"""The sender's connections to handoff listeners: reused, replaced when the listener went away,
and a listener that cannot be reached is not tried again at once; and the choice a handoff
makes from what the receiver offers."""

from __future__ import annotations

import asyncio
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.pb.flashsplit.v1 import decode_pb2
from decode_service.tcp_listener import TcpHandoffListener
from prefill_service.handoff_stream import (SECOND_TCP_CONNECTION_BYTES, HandoffStream,
                                            HandoffTransportError, tcp_connections_for)
from prefill_service.tcp_connections import TcpConnections
from common.handoff.stream import header_of
from tests.common.handoff.conftest import config, fingerprint, layout, make_payload  # noqa: F401
from tests.ports import closed_port


def test_idle_connections_are_reused_and_dead_ones_replaced():
    listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True)
    connections = TcpConnections(None)
    first = connections.acquire("127.0.0.1", listener.port)
    connections.release(first)
    assert connections.acquire("127.0.0.1", listener.port) is first
    connections.release(first)
    listener.close()  # a restart: the idle connection's other end is gone
    for _ in range(200):  # until its close has reached this end
        if not first.alive():
            break
        time.sleep(0.01)
    listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True)
    with pytest.raises(OSError):
        connections.acquire("127.0.0.1", first.peer[1])  # found dead, nothing listens
    fresh = connections.acquire("127.0.0.1", listener.port)
    assert fresh is not first and fresh.alive()
    connections.close()
    listener.close()


def test_an_unreachable_listener_is_not_tried_again_at_once():
    port = closed_port()
    connections = TcpConnections(None, retry_after_s=60)
    with pytest.raises(ConnectionRefusedError):
        connections.acquire("127.0.0.1", port)
    with pytest.raises(ConnectionError, match="not retried"):
        connections.acquire("127.0.0.1", port)
    retrying = TcpConnections(None, retry_after_s=0)
    for _ in range(2):
        with pytest.raises(ConnectionRefusedError):
            retrying.acquire("127.0.0.1", port)


class _AcceptingCall:
    """The receiver's half of a call, as far as ``HandoffStream.open`` sees it."""

    def __init__(self, accepted: decode_pb2.HandoffAccepted) -> None:
        self.accepted = accepted
        self.cancelled = False

    async def write(self, message) -> None:
        pass

    async def read(self):
        return decode_pb2.HandoffReply(accepted=self.accepted)

    def cancel(self) -> None:
        self.cancelled = True


def _open(transport: str, accepted: decode_pb2.HandoffAccepted, connections: TcpConnections,
          payload, tcp_connections: int | None = None, opened: list | None = None):
    """Open a handoff of ``payload``: (whether it went over TCP, whether its call was
    cancelled); ``opened`` gets the number of connections it took."""
    async def scenario():
        call = _AcceptingCall(accepted)
        header = header_of(payload)
        stream = HandoffStream(call, header, reader=None, executor=ThreadPoolExecutor(1),
                               address=f"127.0.0.1:{accepted.tcp_port or 1}",
                               transport=transport, tcp=connections,
                               tcp_connections=tcp_connections)
        try:
            await stream.open()
        finally:
            over_tcp = stream.over_tcp
            if opened is not None:
                opened.append(stream.tcp_connection_count)
            stream.cancel()
        return over_tcp, call.cancelled

    return asyncio.run(scenario())


def test_a_large_handoff_takes_a_second_connection_unless_told_how_many():
    limit = SECOND_TCP_CONNECTION_BYTES
    assert [tcp_connections_for(n, None) for n in (1, limit - 1, limit, 10 * limit)] == \
        [1, 1, 2, 2]
    assert tcp_connections_for(10 * limit, 1) == 1
    assert tcp_connections_for(1, 3) == 3


@pytest.mark.parametrize("asked", [None, 3])
def test_a_handoff_opens_the_connections_it_is_given(asked, make_payload):
    listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True)
    accepted = decode_pb2.HandoffAccepted(handoff_id=1, tcp_port=listener.port,
                                          tcp_ticket=b"t" * 16)
    opened: list[int] = []
    _open("tcp", accepted, TcpConnections(None), make_payload(5), asked, opened)
    assert opened == [asked or 1]  # a 5-token payload is small: one connection by default
    listener.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_handoff_takes_the_listener_it_is_offered(transport, make_payload):
    listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True)
    accepted = decode_pb2.HandoffAccepted(handoff_id=1, tcp_port=listener.port,
                                          tcp_ticket=b"t" * 16)
    # connected (and cancelled by the test's end, which ends the call)
    assert _open(transport, accepted, TcpConnections(None), make_payload(5)) == (True, True)
    listener.close()


def test_auto_streams_when_the_listener_cannot_be_reached(make_payload):
    accepted = decode_pb2.HandoffAccepted(handoff_id=1, tcp_port=closed_port(),
                                          tcp_ticket=b"t" * 16)
    over_tcp, _ = _open("auto", accepted, TcpConnections(None), make_payload(5))
    assert not over_tcp  # its chunks go on the stream


@pytest.mark.parametrize("offer_port", [True, False])
def test_tcp_fails_clearly_without_a_reachable_listener(offer_port, make_payload):
    accepted = decode_pb2.HandoffAccepted(handoff_id=1, tcp_port=closed_port() if offer_port
                                          else 0, tcp_ticket=b"t" * 16)
    with pytest.raises(HandoffTransportError, match="takes no chunks over TCP"):
        _open("tcp", accepted, TcpConnections(None), make_payload(5))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            break
        out += got
    return bytes(out)


def test_frames_are_written_from_their_parts_and_each_released_once():
    from common.handoff.tcp_frames import FRAME_HEADER_BYTES, parse_frame_header
    from prefill_service.tcp_connections import Frame, TcpConnection, send_chunks

    ours, theirs = socket.socketpair()
    connection = TcpConnection(ours, ("pair", 0))
    released: dict[int, int] = {}
    payloads = [bytes([i]) * (300_000 + i) for i in range(5)]  # larger than a socket buffer
    frames = [Frame((b"pre%d" % i, memoryview(bytearray(p))),
                    lambda i=i: released.__setitem__(i, released.get(i, 0) + 1))
              for i, p in enumerate(payloads)]
    ticket = bytes(range(16))
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send_chunks, [connection], ticket, frames)
        for i, payload in enumerate(payloads):
            got_ticket, nbytes = parse_frame_header(_read_exactly(theirs, FRAME_HEADER_BYTES))
            assert got_ticket == ticket
            assert _read_exactly(theirs, nbytes) == b"pre%d" % i + payload
        sent, count = sending.result(10)
    assert count == 5 and sent == sum(len(p) + 4 for p in payloads)
    assert released == {i: 1 for i in range(5)}
    connection.close()
    theirs.close()


def test_frames_that_cannot_be_written_are_released_too():
    from prefill_service.tcp_connections import Frame, TcpConnection, send_chunks

    ours, theirs = socket.socketpair()
    theirs.close()  # the receiver went away: the first write fails
    connection = TcpConnection(ours, ("pair", 0))
    released: list[int] = []
    frames = [Frame((b"x" * 100_000,), lambda i=i: released.append(i)) for i in range(6)]
    with pytest.raises(OSError):
        send_chunks([connection], bytes(16), iter(frames))
    connection.close()
    for _ in range(100):  # the writer thread drops what was still queued
        if len(released) == 6:
            break
        time.sleep(0.01)
    assert sorted(released) == list(range(6))


def test_the_connection_count_flag_takes_auto_or_a_positive_count():
    from prefill_service.__main__ import build_parser

    def parsed(*argv):
        return build_parser().parse_args(list(argv)).handoff_tcp_connections

    assert parsed() is None  # auto: by the handoff's size
    assert parsed("--handoff-tcp-connections", "auto") is None
    assert parsed("--handoff-tcp-connections", "2") == 2
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parsed("--handoff-tcp-connections", bad)
