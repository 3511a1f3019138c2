"""TLS on the handoff's TCP connections: frames arrive whole through it, with the hello's token
checked inside it, and a sender the listener cannot trust (or that cannot trust it) is refused
before any frame."""

from __future__ import annotations

import asyncio
import socket

import pytest

from common.handoff.tcp_frames import hello
from common.handoff.tcp_tls import client_context, server_context
from common.tls import TlsFiles
from decode_service.tcp_listener import TcpHandoffListener
from prefill_service.tcp_connections import Frame, TcpConnections, send_chunks
from tests.tls_certs import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def files(identity, ca) -> TlsFiles:
    return TlsFiles.load(identity.cert if identity else None,
                         identity.key if identity else None, ca)


def listener(pki, *, mutual: bool = True, token: str | None = "t0ken") -> TcpHandoffListener:
    context = server_context(files(pki.server, pki.ca), require_client_cert=mutual)
    return TcpHandoffListener("127.0.0.1", 0, lambda given: given == token, ssl_context=context)


def frames_through(tcp: TcpHandoffListener, connections: TcpConnections,
                   messages: list[bytes]) -> list[bytes]:
    """Send ``messages`` (frames of one handoff) over two connections; what the listener's
    inbox received, in order of arrival."""
    async def scenario():
        offer = tcp.offer(asyncio.get_running_loop())

        def send() -> int:
            held = [connections.acquire("127.0.0.1", tcp.port) for _ in range(2)]
            try:
                return send_chunks(held, offer.ticket, [Frame((m[:3], memoryview(m)[3:]))
                                                        for m in messages])[1]
            finally:
                for connection in held:
                    connections.release(connection)

        sent = await asyncio.to_thread(send)
        got = []
        for _ in range(sent):
            frame = await asyncio.wait_for(offer.inbox.get(), 10)
            assert not isinstance(frame, str), frame
            got.append(bytes(frame.data))
            frame.release()
        offer.withdraw()
        return got

    return asyncio.run(scenario())


def test_frames_arrive_whole_over_mutual_tls_and_connections_are_reused(pki):
    tcp = listener(pki)
    connections = TcpConnections("t0ken", ssl_context=client_context(files(pki.client, pki.ca)))
    messages = [bytes([i % 251]) * n for i, n in enumerate((5, 70_000, 3 << 20, 1, 17))]
    try:
        assert sorted(frames_through(tcp, connections, messages)) == sorted(messages)
        first = connections.acquire("127.0.0.1", tcp.port)
        assert first.alive()
        connections.release(first)
        # the next handoff takes the idle connections again
        assert sorted(frames_through(tcp, connections, messages[:2])) == sorted(messages[:2])
        assert tcp.buffers.num_buffers == 0
    finally:
        connections.close()
        tcp.close()


@pytest.mark.parametrize("case", ["no_client_cert", "stranger_cert", "distrusts_listener",
                                  "plaintext", "wrong_token"])
def test_a_sender_that_cannot_be_trusted_is_refused(pki, case):
    tcp = listener(pki)
    try:
        if case == "plaintext":
            sock = socket.create_connection(("127.0.0.1", tcp.port), timeout=5)
            sock.sendall(hello("t0ken"))
            try:  # the handshake fails: the connection is closed (or reset), never OK
                assert sock.recv(1) != b"\x01"
            except ConnectionResetError:
                pass
            sock.close()
            return
        tls = {"no_client_cert": files(None, pki.ca),
               "stranger_cert": files(pki.stranger, pki.ca),
               "distrusts_listener": files(pki.client, pki.stranger_ca),
               "wrong_token": files(pki.client, pki.ca)}[case]
        token = "guess" if case == "wrong_token" else "t0ken"
        connections = TcpConnections(token, ssl_context=client_context(tls))
        with pytest.raises(OSError):
            connections.acquire("127.0.0.1", tcp.port)
        connections.close()
    finally:
        tcp.close()


def test_a_listener_without_a_certificate_or_ca_is_a_caller_mistake(pki):
    with pytest.raises(ValueError, match="--tls-cert"):
        server_context(files(None, pki.ca), require_client_cert=False)
    no_ca = TlsFiles.load(pki.server.cert, pki.server.key, None)
    with pytest.raises(ValueError, match="--tls-ca"):
        server_context(no_ca, require_client_cert=True)
    server_context(no_ca, require_client_cert=False)  # verifies no sender: allowed
