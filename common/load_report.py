"""A worker's load as the router sees it (the wire form is ``flashsplit.v1.LoadReport``)."""

from __future__ import annotations

from dataclasses import dataclass, field

WORKER_KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class LoadReport:
    """What one worker reports for worker choice: pool occupancy, queue, running requests.

    ``kind`` is "prefill" or "decode"; ``counters`` are monotonic totals by name, read from the
    worker's metrics object (``PrefillMetrics`` / ``DecodeMetrics.load_counters``: the names
    are listed in docs/metrics.md).
    """

    kind: str
    address: str = ""
    model_fingerprint: str = ""
    free_pages: int = 0
    total_pages: int = 0
    free_slots: int = 0
    total_slots: int = 0
    queue_len: int = 0
    running: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    # the longest request the worker's pool could ever hold, in tokens (0 = not reported)
    max_request_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKER_KINDS:
            raise ValueError(f"kind must be one of {WORKER_KINDS}, got {self.kind!r}")
        if self.free_pages > self.total_pages or self.free_slots > self.total_slots:
            raise ValueError(f"free exceeds total: pages {self.free_pages}/{self.total_pages}, "
                             f"slots {self.free_slots}/{self.total_slots}")
