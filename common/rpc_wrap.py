"""Rebuild a gRPC method handler around a wrapped behaviour: what server interceptors return.

A ``grpc.RpcMethodHandler`` holds one behaviour of four kinds (unary or streaming request and
response). ``rewrap`` gives a handler of the same kind, serializers kept, with the behaviour
replaced by ``wrap(behaviour)`` and, when given, a different request deserializer.

``grpc.aio`` decides how to run a behaviour by the kind of function it is, not by what it
returns: a wrapper of a streaming-response behaviour must be an async generator function when
the behaviour is one, and a coroutine function when the behaviour is (it then writes its
messages with ``context.write``, as the health service's ``Watch`` does).
"""

from __future__ import annotations

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
