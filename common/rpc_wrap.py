"""Rebuild a gRPC method handler around a wrapped behaviour: what server interceptors return.

A ``grpc.RpcMethodHandler`` holds one behaviour of four kinds (unary or streaming request and
response). ``rewrap`` gives a handler of the same kind, serializers kept, with the behaviour
replaced by ``wrap(behaviour)`` and, when given, a different request deserializer.

``grpc.aio`` decides how to run a behaviour by the kind of function it is: a coroutine function
writes its messages with ``context.write`` (as the health service's ``Watch`` does), and any
other is iterated. A wrapper of a streaming-response behaviour is therefore a coroutine function
when the behaviour is one, and otherwise returns an async iterator: ``delegate`` of the
behaviour's, so that what is thrown in reaches the behaviour.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any, Callable

import grpc

Behavior = Callable[..., Any]

_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def rewrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior], Behavior],
           request_deserializer: Callable[[bytes], Any] | None = None
           ) -> grpc.RpcMethodHandler:
    """A handler like ``handler`` whose behaviour is ``wrap(handler's behaviour)``."""
    attr, factory = _FACTORIES[(bool(handler.request_streaming),
                                bool(handler.response_streaming))]
    return factory(wrap(getattr(handler, attr)),
                   request_deserializer=request_deserializer or handler.request_deserializer,
                   response_serializer=handler.response_serializer)


async def delegate(inner: AsyncIterator[Any],
                   before: Awaitable[Any] | None = None) -> AsyncIterator[Any]:
    """Await ``before`` (if any), then yield what ``inner`` yields, passing on what is thrown
    in. A wrapper written ``async for item in inner: yield item`` would raise an exception
    thrown into it (``athrow``) at its own yield, never in ``inner``, which is where a
    behaviour handles it: the shutdown's expiry throws a CancelledError in at the yield a
    streaming behaviour waits at (``common/shutdown.py``). Python has no ``yield from`` for
    async generators; this is it. A wrapper returns ``delegate(...)`` from a plain function,
    which gRPC runs as a streaming behaviour (it is not a coroutine function)."""
    items = inner.__aiter__()
    try:
        if before is not None:
            await before
        try:
            item = await items.__anext__()
        except StopAsyncIteration:
            return
        while True:
            try:
                yield item
            except GeneratorExit:
                raise  # closed: the finally closes inner
            except BaseException as exc:  # noqa: BLE001 - thrown in: inner decides
                try:
                    item = await items.athrow(exc)
                except StopAsyncIteration:
                    return
            else:
                try:
                    item = await items.__anext__()
                except StopAsyncIteration:
                    return
    finally:
        await items.aclose()
