"""Histogram bucket bounds shared by the services' metrics."""

from __future__ import annotations


def exponential_buckets(start: float, factor: float, count: int) -> tuple[float, ...]:
    """``count`` upper bounds ``start, start·factor, ...`` (Prometheus adds ``+Inf``)."""
    if start <= 0 or factor <= 1 or count < 1:
        raise ValueError(f"need start > 0, factor > 1, count >= 1; got {start}, {factor}, {count}")
    return tuple(start * factor ** i for i in range(count))


# request phases: 1 ms to about 4.4 minutes (a long prompt queued behind others on a CPU)
LATENCY_S = exponential_buckets(0.001, 2.0, 19)
# gaps between tokens: 0.25 ms (a fast GPU decode step) to about 8 s (a stall)
TOKEN_GAP_S = exponential_buckets(0.00025, 2.0, 16)
# one engine step: 62.5 us (a small model's graphed decode step) to about 8 s (a long prefill)
STEP_S = exponential_buckets(0.0000625, 2.0, 18)
# handoff payloads: 1 KiB to 64 GiB (a long prompt's KV on a large model)
BYTES = exponential_buckets(1024.0, 4.0, 14)
# requests in one engine step: 1 to 512
BATCH = exponential_buckets(1.0, 2.0, 10)


def accept_length_buckets(block_size: int) -> tuple[float, ...]:
    """One bucket per possible accept length of a DFLASH step: 1 (no draft accepted) to
    ``block_size`` (every draft accepted, plus the bonus token)."""
    if block_size < 1:
        raise ValueError(f"block size must be at least 1, got {block_size}")
    return tuple(float(n) for n in range(1, block_size + 1))
