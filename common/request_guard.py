"""Requests that cannot be parsed, or are too large, answer INVALID_ARGUMENT with a clear message.

Left to itself, gRPC answers a request whose bytes are not a valid protobuf message (or whose
string field is not valid UTF-8, which proto3 requires) with UNKNOWN and the name of a Python
exception. ``RequestGuard`` deserializes each request message itself: a message it cannot
parse, or one larger than ``max_message_bytes``, becomes a refusal that the behaviour answers
with INVALID_ARGUMENT before the servicer sees anything. In a request stream the refusal ends
the call at the message that could not be parsed.

Size: gRPC's own receive limit must sit above ``max_message_bytes`` (``make_server`` sets it
to twice that), so that a message between the two is refused here, with INVALID_ARGUMENT; one
beyond gRPC's limit gets gRPC's RESOURCE_EXHAUSTED before it is read into memory.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any, Awaitable, Callable

import grpc

from common.rpc_wrap import Behavior, delegate, rewrap


class _Refused:
    """What the guarded deserializer returns instead of a message it will not pass on."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _guarded_deserializer(deserialize: Callable[[bytes], Any], method: str,
                          max_bytes: int | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return _Refused(f"{method}: a request message of {len(data)} bytes; at most "
                            f"{max_bytes} are accepted")
        try:
            return deserialize(data)
        except Exception:  # noqa: BLE001 - whatever the parser raises, the bytes are bad
            return _Refused(f"{method}: the request is not a valid protobuf message of this "
                            "method's type (or one of its string fields is not valid UTF-8)")
    return parse


async def _refuse(refused: _Refused, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused.reason)


async def _checked(requests: AsyncIterator[Any],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for message in requests:
        if isinstance(message, _Refused):
            await _refuse(message, context)
        yield message


def _wrap(behavior: Behavior, request_streaming: bool, response_streaming: bool) -> Behavior:
    # a streaming behaviour written as a coroutine (context.write) is wrapped as one too
    response_streaming = response_streaming and not inspect.iscoroutinefunction(behavior)
    if request_streaming and response_streaming:
        def stream_stream(requests, context):
            return delegate(behavior(_checked(requests, context), context))
        return stream_stream
    if request_streaming:
        async def stream_unary(requests, context):
            return await behavior(_checked(requests, context), context)
        return stream_unary
    if response_streaming:
        def unary_stream(request, context):
            refuse = _refuse(request, context) if isinstance(request, _Refused) else None
            return delegate(behavior(request, context), refuse)
        return unary_stream

    async def unary_unary(request, context):
        if isinstance(request, _Refused):
            await _refuse(request, context)
        return await behavior(request, context)
    return unary_unary


class RequestGuard(grpc.aio.ServerInterceptor):
    """Parses every request message itself; see the module docstring.

    ``max_message_bytes`` None leaves the size to gRPC's own limit.
    """

    def __init__(self, max_message_bytes: int | None = None) -> None:
        if max_message_bytes is not None and max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
        self.max_message_bytes = max_message_bytes

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler  # unknown method (gRPC answers UNIMPLEMENTED), or raw bytes
        deserializer = _guarded_deserializer(handler.request_deserializer,
                                             handler_call_details.method,
                                             self.max_message_bytes)
        return rewrap(handler, lambda b: _wrap(b, bool(handler.request_streaming),
                                               bool(handler.response_streaming)), deserializer)
