"""Shared-secret authentication of gRPC calls: the checks and the server interceptor.

Two secrets travel as call metadata:

- the internal token, ``x-flashsplit-token: <token>``, on every call between the router and the
  workers and between the workers (Prefill, Decode: Handoff, Stream, Abort, GetLoad);
- the API key of the public router port, ``authorization: Bearer <key>``, as OpenAI clients
  send it (``bearer_key_matches`` is the same check for an HTTP front end).

Both are compared in constant time. ``grpc.health.v1`` stays open so that orchestrators can
probe a port without a secret. See docs/security.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import grpc

TOKEN_HEADER = "x-flashsplit-token"
AUTHORIZATION_HEADER = "authorization"
# Services any caller may reach on an authenticated port.
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
# Long enough that guessing is hopeless; new_secret() gives 43 characters.
MIN_SECRET_CHARS = 16
# How long a refused client-streaming call may take to send its first message (see
# _refusing_handler).
_FIRST_MESSAGE_WAIT_S = 1.0


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe base64)."""
    return secrets.token_urlsafe(32)


def check_secret(secret: str, what: str, min_chars: int = MIN_SECRET_CHARS) -> str:
    """``secret`` stripped of surrounding whitespace; ValueError when it is shorter than
    ``min_chars`` or cannot travel as a metadata value."""
    secret = secret.strip()
    if len(secret) < max(min_chars, 1):
        raise ValueError(f"{what} must be at least {max(min_chars, 1)} characters "
                         f"(got {len(secret)})")
    if any(c.isspace() or not c.isprintable() for c in secret):
        # it travels as a metadata value, which cannot hold these
        raise ValueError(f"{what} must not contain whitespace or control characters")
    return secret


def read_secret_file(path: str, what: str, min_chars: int = MIN_SECRET_CHARS) -> str:
    """The secret held in file ``path`` (surrounding whitespace, e.g. a newline, removed)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} file {path}: cannot read it ({exc})") from None
    return check_secret(text, f"{what} in {path}", min_chars)


def file_is_private(path: str) -> bool:
    """True when neither group nor others may read ``path`` (mode 0600 or stricter)."""
    return not os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO)


def write_secret_file(path: str | Path, secret: str) -> None:
    """Write ``secret`` to a new file readable by its owner only (0600 from creation on)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")


def secrets_match(given: str | bytes | None, expected: str) -> bool:
    """Constant-time comparison (its time does not depend on how much of ``given`` is right)."""
    if given is None:
        return False
    if isinstance(given, str):
        given = given.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, expected.encode("utf-8"))


def bearer_key_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (scheme in any case)."""
    if not authorization:
        return False
    scheme, _, key = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and secrets_match(key.strip(), api_key)


@dataclass(frozen=True)
class MetadataCheck:
    """One metadata entry a call must carry: ``header``'s value must pass ``accept``."""

    header: str
    accept: Callable[[str | None], bool] = field(repr=False)
    # what the refusal says; never includes what the caller sent
    refusal: str

    @classmethod
    def internal_token(cls, token: str) -> MetadataCheck:
        return cls(TOKEN_HEADER, lambda value: secrets_match(value, token),
                   f"missing or wrong internal token (metadata {TOKEN_HEADER!r})")

    @classmethod
    def api_key(cls, key: str) -> MetadataCheck:
        return cls(AUTHORIZATION_HEADER, lambda value: bearer_key_matches(value, key),
                   "missing or wrong API key (metadata 'authorization: Bearer <key>')")


def _metadata_value(metadata, header: str) -> str | None:
    for key, value in metadata or ():
        if key == header:  # gRPC lower-cases metadata keys on the wire
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


def _service_of(method: str) -> str:
    """``/pkg.Service/Method`` -> ``pkg.Service``."""
    return method.lstrip("/").split("/", 1)[0]


def _refusing_handler(handler: grpc.RpcMethodHandler | None,
                      message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED
    before reading any request (so nothing of the caller's reaches the servicer)."""

    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(requests, context):
        # NOTE: a grpc.aio client whose write is still in flight when the status arrives reports
        # INTERNAL "Internal error from Core" instead of it (grpc#36066). Our clients write one
        # message and then wait for a reply (Decode.Handoff's header), so taking that first
        # message, for a bounded time, before refusing makes them see UNAUTHENTICATED.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(anext(aiter(requests)), _FIRST_MESSAGE_WAIT_S)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:  # an unknown method: refuse it too, not UNIMPLEMENTED, to reveal nothing
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(refuse_stream if handler.request_streaming else refuse,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call outside ``OPEN_SERVICES`` that fails
    ``check``."""

    def __init__(self, check: MetadataCheck) -> None:
        self.check = check

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if _service_of(handler_call_details.method) in OPEN_SERVICES:
            return await continuation(handler_call_details)
        value = _metadata_value(handler_call_details.invocation_metadata, self.check.header)
        handler = await continuation(handler_call_details)
        if self.check.accept(value):
            return handler
        return _refusing_handler(handler, self.check.refusal)
