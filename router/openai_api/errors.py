"""Errors of the HTTP API in OpenAI's shape, and the one table from gRPC statuses to HTTP codes.

Every failure a client sees is ``{"error": {"message", "type", "param", "code"}}`` with an HTTP
status that the official clients map to their exception classes (400 ``BadRequestError``, 401
``AuthenticationError``, 404 ``NotFoundError``, 429 ``RateLimitError``, 5xx
``InternalServerError``). Failures inside the router arrive as ``DispatchError`` with a gRPC
status; ``STATUS_TABLE`` is the only place that says what each becomes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import grpc

Code = grpc.StatusCode


@dataclass(frozen=True)
class HttpStatus:
    """What one gRPC status becomes over HTTP: the status code and OpenAI's error type."""

    status: int
    type: str
    code: str | None = None


STATUS_TABLE: Mapping[grpc.StatusCode, HttpStatus] = MappingProxyType({
    Code.INVALID_ARGUMENT: HttpStatus(400, "invalid_request_error"),
    Code.OUT_OF_RANGE: HttpStatus(400, "invalid_request_error"),
    Code.FAILED_PRECONDITION: HttpStatus(400, "invalid_request_error"),
    Code.UNIMPLEMENTED: HttpStatus(400, "invalid_request_error", "not_supported"),
    Code.UNAUTHENTICATED: HttpStatus(401, "authentication_error", "invalid_api_key"),
    Code.PERMISSION_DENIED: HttpStatus(403, "permission_error"),
    Code.NOT_FOUND: HttpStatus(404, "not_found_error"),
    # every worker is up but full: come back later
    Code.RESOURCE_EXHAUSTED: HttpStatus(429, "rate_limit_error", "overloaded"),
    # no worker pair could take the request
    Code.UNAVAILABLE: HttpStatus(503, "service_unavailable_error", "unavailable"),
    Code.DEADLINE_EXCEEDED: HttpStatus(504, "timeout_error", "timeout"),
    Code.CANCELLED: HttpStatus(503, "service_unavailable_error", "cancelled"),
    Code.ABORTED: HttpStatus(503, "service_unavailable_error", "aborted"),
})
_SERVER_ERROR = HttpStatus(500, "server_error")  # INTERNAL, DATA_LOSS, UNKNOWN, and bugs


def http_status(code: grpc.StatusCode) -> HttpStatus:
    """The HTTP side of a gRPC status (500 for any status not in the table)."""
    return STATUS_TABLE.get(code, _SERVER_ERROR)


class ApiError(Exception):
    """A failure answered in OpenAI's error shape."""

    def __init__(self, grpc_code: grpc.StatusCode, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.http = http_status(grpc_code)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.http.code

    @property
    def status(self) -> int:
        return self.http.status

    def body(self) -> dict:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.http.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 for a request the server will not run as sent."""
    return ApiError(Code.INVALID_ARGUMENT, message, param=param)


def not_supported(what: str, param: str) -> ApiError:
    """A 400 for a field the server understands but cannot honour yet (never silently ignored)."""
    return ApiError(Code.UNIMPLEMENTED, f"{what} is not supported yet", param=param)
