"""A small gRPC service over the real server plumbing (``make_server``), for tests of what
wraps every call: request parsing, graceful shutdown.

``test.Toy`` has one method of each kind. Messages are ``AbortRequest`` in (``handoff_id`` is a
duration in milliseconds or a count, as each method says) and ``AbortResponse`` out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from common.grpc_util import bind, make_server
from common.pb.flashsplit.v1 import types_pb2
from common.shutdown import GracefulShutdown

SERVICE = "test.Toy"
_REQ = dict(request_deserializer=types_pb2.AbortRequest.FromString,
            response_serializer=types_pb2.AbortResponse.SerializeToString)


@dataclass
class Toy:
    """What the toy servicer saw: how many calls finished or were cut short."""

    shutdown: GracefulShutdown
    finished: list[str] = field(default_factory=list)
    cleaned_up: list[str] = field(default_factory=list)

    async def sleep(self, request, context):
        """Unary: sleeps ``handoff_id`` ms, then answers found=True."""
        try:
            await asyncio.sleep(request.handoff_id / 1000)
        finally:
            self.cleaned_up.append("sleep")
        self.finished.append("sleep")
        return types_pb2.AbortResponse(found=True)

    async def ticks(self, request, context):
        """Server stream: one message every 20 ms, ``handoff_id`` of them; when the grace
        expires it ends with a last message found=False (a proper end, as Decode.Stream's).
        Only the wait is inside ``cancelled_at_expiry``, as in Decode.Stream: a cancellation
        that landed while gRPC writes a message would end the call before that last message."""
        try:
            for _ in range(request.handoff_id):
                try:
                    with self.shutdown.cancelled_at_expiry():
                        await asyncio.sleep(0.02)
                except asyncio.CancelledError:
                    if not self.shutdown.expired.is_set():
                        raise
                    yield types_pb2.AbortResponse(found=False)
                    return
                yield types_pb2.AbortResponse(found=True)
        finally:
            self.cleaned_up.append("ticks")
        self.finished.append("ticks")

    async def blind_ticks(self, request, context):
        """Server stream that knows nothing of shutdown: a message every 20 ms."""
        for _ in range(request.handoff_id):
            await asyncio.sleep(0.02)
            yield types_pb2.AbortResponse(found=True)
        self.finished.append("blind_ticks")

    async def count(self, requests, context):
        """Client stream: answers found=True after reading every message."""
        n = 0
        async for _ in requests:
            n += 1
        self.finished.append(f"count:{n}")
        return types_pb2.AbortResponse(found=n > 0)

    async def echo(self, requests, context):
        """Bidirectional: one answer per message."""
        async for _ in requests:
            yield types_pb2.AbortResponse(found=True)


async def start_toy(*, max_message_bytes: int | None = None,
                    final_s: float = 0.5) -> tuple[grpc.aio.Server, Toy, str, object]:
    """A started toy server on 127.0.0.1; returns (server, toy, address, health servicer)."""
    shutdown = GracefulShutdown("toy server", final_s=final_s)
    server, health = make_server([shutdown.interceptor()], max_message_bytes=max_message_bytes)
    toy = Toy(shutdown)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Sleep": grpc.unary_unary_rpc_method_handler(toy.sleep, **_REQ),
        "Ticks": grpc.unary_stream_rpc_method_handler(toy.ticks, **_REQ),
        "BlindTicks": grpc.unary_stream_rpc_method_handler(toy.blind_ticks, **_REQ),
        "Count": grpc.stream_unary_rpc_method_handler(toy.count, **_REQ),
        "Echo": grpc.stream_stream_rpc_method_handler(toy.echo, **_REQ),
    }),))
    address = bind(server, "127.0.0.1", 0)
    await server.start()
    return server, toy, address, health


def stub(channel: grpc.aio.Channel, method: str, kind: str, raw: bool = False):
    """A callable for ``test.Toy/<method>``; ``raw`` sends bytes as they are."""
    make = {"uu": channel.unary_unary, "us": channel.unary_stream,
            "su": channel.stream_unary, "ss": channel.stream_stream}[kind]
    return make(f"/{SERVICE}/{method}",
                request_serializer=None if raw else types_pb2.AbortRequest.SerializeToString,
                response_deserializer=types_pb2.AbortResponse.FromString)
