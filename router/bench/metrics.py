"""One load point's numbers: latency percentiles and throughput over its requests.

Latencies are taken over successful requests: time to first token (TTFT), inter-token latency
(ITL, every gap between tokens of every request), time per output token after the first (TPOT,
one value per request: (e2e - TTFT) / (tokens - 1)) and end-to-end latency (E2E). Throughput is
over the load point's wall time, from its first request sent to its last answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from router.bench.backends import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Stats:
    """mean and percentiles of one latency, in milliseconds (0 when there is no sample)."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Stats:
        if not len(seconds):
            return cls(0.0, 0.0, 0.0, 0.0, 0)
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), p50, p90, p99, int(ms.size))


@dataclass(frozen=True)
class Summary:
    """What the table, the JSON and the plots show for one load point."""

    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float   # completed requests per second
    output_throughput: float    # generated tokens per second
    total_throughput: float     # prompt + generated tokens per second
    max_in_flight: int
    ttft: Stats
    itl: Stats
    tpot: Stats
    e2e: Stats
    first_error: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def max_in_flight(results: Sequence[RequestResult]) -> int:
    """The most requests that were outstanding at once."""
    events = sorted([(r.start_s, 1) for r in results] +
                    [(r.start_s + r.e2e_s, -1) for r in results], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def summarize(results: Sequence[RequestResult], duration_s: float) -> Summary:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return Summary(
        completed=len(ok), failed=len(failed), duration_s=duration_s,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        request_throughput=len(ok) * per_s, output_throughput=output_tokens * per_s,
        total_throughput=(prompt_tokens + output_tokens) * per_s,
        max_in_flight=max_in_flight(results),
        ttft=Stats.of([r.ttft_s for r in ok if r.output_tokens]),
        itl=Stats.of([gap for r in ok for gap in r.itl_s]),
        tpot=Stats.of(tpot), e2e=Stats.of([r.e2e_s for r in ok]),
        first_error=failed[0].error if failed else "")
