"""How a dispatch attempt fails: retry on another pair (``AttemptFailed``), wait for room
(``EveryDecodeFull``) or end the request with a status (``DispatchError``), and which of them a
failed worker call means."""

from __future__ import annotations

import grpc

from router.client import WorkerCallError

Code = grpc.StatusCode
# Prefill statuses that mean the decode side refused or lost the handoff: try another decode
# worker, but the prefill worker is fine.
_DECODE_REFUSALS = {Code.RESOURCE_EXHAUSTED, Code.FAILED_PRECONDITION, Code.DATA_LOSS}
# Prefill statuses that are the request's own fault: retrying elsewhere would fail the same way.
_CLIENT_FAULTS = {Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE}


class DispatchError(Exception):
    """The request failed; ``code`` is the gRPC status the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class EveryDecodeFull(Exception):
    """A round of attempts found no decode worker with room: the request may wait for it."""


class AttemptFailed(Exception):
    """An attempt failed before its first token: the request may be retried on another pair.

    blame: workers to mark down in the registry; exclude: workers this request must not use
    again; full: decode workers that refused for lack of room; unservable: a decode worker
    refused the request as one it cannot serve (FAILED_PRECONDITION, e.g. speculative decoding
    asked of a worker without a draft).
    """

    def __init__(self, message: str, *, blame: tuple[str, ...] = (),
                 exclude: tuple[str, ...] = (), full: tuple[str, ...] = (),
                 unservable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.blame = blame
        self.exclude = tuple(dict.fromkeys(exclude + blame))
        self.full = full
        self.unservable = unservable


def prefill_failure(err: WorkerCallError, prefill: str, decode: str) -> Exception:
    """What a failed Prefill call means: a retryable AttemptFailed, or a final DispatchError."""
    if err.code in _CLIENT_FAULTS:
        return DispatchError(err.code, f"prefill worker {prefill} rejected the request: "
                                       f"{err.details}")
    if err.code in _DECODE_REFUSALS:
        full = (decode,) if err.code == Code.RESOURCE_EXHAUSTED else ()
        return AttemptFailed(f"decode worker {decode} refused the handoff "
                             f"({err.code.name}: {err.details})", exclude=(decode,), full=full,
                             unservable=err.code == Code.FAILED_PRECONDITION)
    # UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL and the rest: the prefill worker (or its link to
    # decode) failed. A dead decode worker shows first as a broken Stream, which is checked
    # before this, so the prefill worker is the one blamed here.
    return AttemptFailed(f"prefill worker {prefill} failed ({err.code.name}: {err.details})",
                         blame=(prefill,))


def stream_failure(err: WorkerCallError, decode: str) -> AttemptFailed:
    """What a Decode.Stream that failed before its first token means."""
    if err.code == Code.RESOURCE_EXHAUSTED:
        return AttemptFailed(f"decode worker {decode} has no room ({err.details})",
                             exclude=(decode,), full=(decode,))
    return AttemptFailed(f"decode worker {decode} failed ({err.code.name}: {err.details})",
                         blame=(decode,))
