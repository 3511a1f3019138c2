"""The gRPC status a unary servicer method answered with, for a status-labelled counter.

Kept apart from the metrics objects: this is servicer-side (it knows grpc), they are not.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import grpc


def answered_status(record: Callable[[object, str], None]):
    """Decorate ``async def Method(self, request, context)`` so that once it ends,
    ``record(self, status)`` gets the name of the status the caller sees: OK, the code of a
    ``context.abort``, CANCELLED when the call was cancelled, UNKNOWN for an exception
    (what gRPC answers for one)."""

    def decorate(method):
        @functools.wraps(method)
        async def recorded(self, request, context):
            status = "UNKNOWN"
            try:
                response = await method(self, request, context)
                status = _name(context.code()) or "OK"
                return response
            except grpc.aio.AbortError:
                status = _name(context.code()) or "UNKNOWN"
                raise
            except asyncio.CancelledError:
                status = "CANCELLED"
                raise
            finally:
                record(self, status)

        return recorded

    return decorate


def _name(code) -> str | None:
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return code.name
    # grpc.aio may hand back the numeric code
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), None)
