"""The handoff listener on its own: the hello's token, frames to their offer's inbox, flow
control, and frames nobody holds."""

from __future__ import annotations

import asyncio
import socket

import pytest

from common.handoff.tcp_frames import OK, frame_header, hello
from decode_service.tcp_listener import TcpHandoffListener
from prefill_service.tcp_connections import TcpConnections


def _connect(port: int, token: str | None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(hello(token))
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the listener closed ``sock``: an end of stream, or a reset when it closed with
    bytes of ours still unread."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_wrong_token_is_shut_out():
    listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: token == "right")
    try:
        sock = _connect(listener.port, "wrong")
        assert _closed_by_peer(sock)  # closed without a word
        sock.close()
        sock = _connect(listener.port, "right")
        assert sock.recv(1) == OK
        sock.close()
        with pytest.raises(ConnectionRefusedError, match="another internal token"):
            TcpConnections("wrong").acquire("127.0.0.1", listener.port)
    finally:
        listener.close()


def test_frames_reach_their_offer_and_hold_the_connection_until_taken():
    async def scenario():
        listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True, max_ahead=2)
        loop = asyncio.get_running_loop()
        a, b = listener.offer(loop), listener.offer(loop)
        connections = TcpConnections(None)
        connection = await asyncio.to_thread(connections.acquire, "127.0.0.1", listener.port)
        for i in range(4):
            connection.submit((a, b)[i % 2].ticket, bytes([i]) * 100)
        await asyncio.to_thread(connection.flush)  # the kernel holds what the reader does not
        await asyncio.sleep(0.2)
        # two frames wait in inboxes, un-taken: the reader stops there
        assert a.inbox.qsize() + b.inbox.qsize() == 2
        taken = []
        while len(taken) < 4:
            for offer in (a, b):
                while not offer.inbox.empty():
                    frame = offer.inbox.get_nowait()
                    taken.append((offer is a, frame.data[0]))
                    frame.release()
            await asyncio.sleep(0.01)
        assert sorted(taken) == [(False, 1), (False, 3), (True, 0), (True, 2)]
        # a withdrawn offer's frames are dropped, queued ones released
        a.withdraw()
        connection.submit(a.ticket, b"x" * 10)
        connection.submit(b.ticket, b"y" * 10)
        await asyncio.to_thread(connection.flush)
        frame = await asyncio.wait_for(b.inbox.get(), 5)
        assert bytes(frame.data) == b"y" * 10 and a.inbox.empty()
        frame.release()
        connections.close()
        listener.close()

    asyncio.run(scenario())


def test_a_broken_connection_tells_the_handoffs_it_carried():
    async def scenario():
        listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True)
        offer = listener.offer(asyncio.get_running_loop())

        def break_inside_a_frame() -> None:
            sock = _connect(listener.port, None)
            assert sock.recv(1) == OK
            sock.sendall(frame_header(offer.ticket, 1000) + b"z" * 10)
            sock.close()

        await asyncio.to_thread(break_inside_a_frame)
        item = await asyncio.wait_for(offer.inbox.get(), 5)
        assert isinstance(item, str) and "broke" in item
        listener.close()

    asyncio.run(scenario())


def test_a_silent_connection_is_dropped_and_connections_are_bounded():
    listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True,
                                  max_connections=2, hello_timeout_s=0.3)
    try:
        silent = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        assert _closed_by_peer(silent)  # no hello within the timeout: closed
        silent.close()
        held = [_connect(listener.port, None) for _ in range(2)]
        assert all(sock.recv(1) == OK for sock in held)
        extra = _connect(listener.port, None)
        assert _closed_by_peer(extra)  # a third while two are open: closed at once
        extra.close()
        for sock in held:
            sock.close()
    finally:
        listener.close()
