"""An in-process gRPC server with one method of each kind, behind a ``ServerSecurity``.

The methods echo raw bytes and count their invocations, so a test can tell a refused call from
one that reached the servicer. ``call_each_kind`` makes one call of each kind on a channel.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_util import bind, make_server, set_serving
from common.security import ServerSecurity

SERVICE = "test.Echo"
KINDS = ("UnaryUnary", "UnaryStream", "StreamUnary", "StreamStream")


@dataclass
class EchoServer:
    server: grpc.aio.Server
    address: str
    invoked: collections.Counter = field(default_factory=collections.Counter)
    metadata: list[tuple] = field(default_factory=list)

    async def stop(self) -> None:
        await self.server.stop(0)


async def start_echo(security: ServerSecurity = ServerSecurity(),
                     host: str = "127.0.0.1") -> EchoServer:
    server, health = make_server(security.interceptors())
    echo = EchoServer(server, "")

    def seen(kind, context):
        echo.invoked[kind] += 1
        echo.metadata.append(tuple(context.invocation_metadata()))

    async def unary_unary(request, context):
        seen("UnaryUnary", context)
        return request

    async def unary_stream(request, context):
        seen("UnaryStream", context)
        yield request
        yield request

    async def stream_unary(requests, context):
        seen("StreamUnary", context)
        return b"".join([r async for r in requests])

    async def stream_stream(requests, context):
        seen("StreamStream", context)
        async for r in requests:
            yield r

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
        "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream),
    }),))
    echo.address = bind(server, host, 0, security.credentials())
    await server.start()
    await set_serving(health, [SERVICE], True)
    return echo


async def _requests(*items: bytes):
    for item in items:
        yield item


async def call_each_kind(channel: grpc.aio.Channel, metadata=None,
                         timeout_s: float = 5.0) -> dict[str, object]:
    """Each kind's answer (bytes, or a list of bytes for streams) or the status code it got."""
    out: dict[str, object] = {}
    calls = {
        "UnaryUnary": lambda: channel.unary_unary(f"/{SERVICE}/UnaryUnary")(
            b"a", metadata=metadata, timeout=timeout_s),
        "UnaryStream": lambda: channel.unary_stream(f"/{SERVICE}/UnaryStream")(
            b"b", metadata=metadata, timeout=timeout_s),
        "StreamUnary": lambda: channel.stream_unary(f"/{SERVICE}/StreamUnary")(
            _requests(b"c", b"d"), metadata=metadata, timeout=timeout_s),
        "StreamStream": lambda: channel.stream_stream(f"/{SERVICE}/StreamStream")(
            _requests(b"e", b"f"), metadata=metadata, timeout=timeout_s),
    }
    for kind, make in calls.items():
        try:
            call = make()
            if kind.endswith("Stream"):
                out[kind] = [m async for m in call]
            else:
                out[kind] = await call
        except grpc.aio.AioRpcError as exc:
            out[kind] = exc.code()
    return out


EXPECTED = {"UnaryUnary": b"a", "UnaryStream": [b"b", b"b"], "StreamUnary": b"cd",
            "StreamStream": [b"e", b"f"]}


async def health_status(channel: grpc.aio.Channel, timeout_s: float = 5.0) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    return reply.status
