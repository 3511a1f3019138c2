"""common/grpc_util.py: binding is exclusive, and a port in use is a clear error."""

from __future__ import annotations

import asyncio
import socket

import pytest

from common.grpc_util import bind, bind_problem, make_server


def test_a_port_in_use_is_an_error_not_a_shared_port():
    async def scenario():
        first, _ = make_server()
        address = bind(first, "127.0.0.1", 0)
        await first.start()
        port = int(address.rsplit(":", 1)[1])
        try:
            assert bind_problem("127.0.0.1", port) == "Address already in use"
            second, _ = make_server()
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: "
                                              "Address already in use"):
                bind(second, "127.0.0.1", port)
        finally:
            await first.stop(0)
        # once the first server is gone the port is free again
        assert bind_problem("127.0.0.1", port) is None

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_plain_socket_listening_also_blocks_the_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]

        async def scenario():
            server, _ = make_server()
            with pytest.raises(OSError, match="in use"):
                bind(server, "127.0.0.1", port)

        asyncio.run(asyncio.wait_for(scenario(), 30))


def test_an_address_not_of_this_host_says_why():
    # TEST-NET-1 is never a local address; binding sends nothing anywhere
    problem = bind_problem("192.0.2.1", 0)
    assert problem is not None and "assign" in problem.lower()

    async def scenario():
        server, _ = make_server()
        with pytest.raises(OSError, match="cannot listen on 192.0.2.1:0: .*assign"):
            bind(server, "192.0.2.1", 0)

    asyncio.run(asyncio.wait_for(scenario(), 30))
