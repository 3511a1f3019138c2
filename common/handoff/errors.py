"""The one exception of the handoff format, carrying the gRPC status the receiver should answer.

The code is the *name* of a ``grpc.StatusCode`` so that this package stays free of grpc; the
decode servicer maps it with ``grpc.StatusCode[err.code]``.
"""

from __future__ import annotations

# code -> when it is used (the table in docs/protocol.md)
HANDOFF_ERROR_CODES = {
    "INVALID_ARGUMENT": "malformed handoff: bad sequence, unknown field, wrong shape, bad chunk",
    "FAILED_PRECONDITION": "sender and receiver disagree on model fingerprint or tensor layout",
    "RESOURCE_EXHAUSTED": "the receiver cannot hold the payload now (pages, slots, byte limit)",
    "DATA_LOSS": "bytes are missing or a field's checksum differs",
    "NOT_FOUND": "the handoff id is unknown to the receiver",
    "ALREADY_EXISTS": "a request with this handoff id is already decoding on the receiver",
    "ABORTED": "the request was aborted before or while its handoff arrived",
    "DEADLINE_EXCEEDED": "the sender sent nothing for the receiver's idle timeout",
    "INTERNAL": "the receiver failed while landing bytes (a bug): this handoff only",
}


class HandoffError(Exception):
    """A handoff refused by validation; ``code`` names the gRPC status to answer with."""

    def __init__(self, code: str, message: str) -> None:
        if code not in HANDOFF_ERROR_CODES:
            raise ValueError(f"unknown handoff error code {code!r}; expected one of "
                             f"{sorted(HANDOFF_ERROR_CODES)}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
