"""Every outgoing gRPC channel: plaintext or TLS, with the caller's secrets on each call.

``make_channel(address, security)`` is the one place a channel is made, so a secret or TLS
setting cannot be forgotten on one path (router -> workers, prefill -> decode, a client of the
public port).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import grpc

from common.auth import AUTHORIZATION_HEADER, TOKEN_HEADER
from common.grpc_util import CHANNEL_OPTIONS
from common.tls import TlsFiles


@dataclass(frozen=True)
class ChannelSecurity:
    """How a channel authenticates: TLS (None = plaintext) and metadata sent on every call."""

    tls: TlsFiles | None = None
    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @classmethod
    def internal(cls, token: str | None, tls: TlsFiles | None = None) -> ChannelSecurity:
        """A channel to a worker: the internal token on every call."""
        return cls(tls=tls, metadata=((TOKEN_HEADER, token),) if token else ())

    @classmethod
    def public(cls, api_key: str | None, tls: TlsFiles | None = None) -> ChannelSecurity:
        """A channel to the router's public port: the API key as a bearer token."""
        return cls(tls=tls, metadata=((AUTHORIZATION_HEADER, f"Bearer {api_key}"),)
                   if api_key else ())


class _AttachMetadata:
    """Adds fixed metadata to every call it intercepts."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*self._metadata)
        for key, value in details.metadata or ():
            metadata.add(key, value)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


# NOTE: one class per call kind: a channel files each interceptor under the first kind it is an
# instance of, so one class deriving from all four would only ever see unary-unary calls.
class _UnaryUnary(_AttachMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_AttachMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_AttachMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_AttachMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details,
                                      request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def make_channel(address: str, security: ChannelSecurity = ChannelSecurity(),
                 options: Sequence[tuple[str, object]] = tuple(CHANNEL_OPTIONS)
                 ) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` (host:port) with ``security`` applied to every call."""
    # no interceptor when there is nothing to attach: it costs a task per call
    interceptors = ([kind(security.metadata) for kind in
                     (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
                    if security.metadata else None)
    if security.tls is None:
        return grpc.aio.insecure_channel(address, options=list(options),
                                         interceptors=interceptors)
    return grpc.aio.secure_channel(address, security.tls.channel_credentials(),
                                   options=list(options), interceptors=interceptors)
