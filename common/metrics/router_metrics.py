"""The router's metrics (``flashsplit_router_*``, docs/metrics.md): what clients see, measured
where they see it. Updated on the router's event loop; read by scrapes from the HTTP API (same
loop) or a ``--metrics-port`` thread."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics.buckets import LATENCY_S, TOKEN_GAP_S

PREFIX = "flashsplit_router"
# the finish_reason label of a request that ended without one (rejected, failed, cancelled)
NO_FINISH = "none"


class RouterMetrics:
    """One router's counters, histograms and gauges, in a registry of their own."""

    def __init__(self, waiting: Callable[[], int] | None = None) -> None:
        """waiting: how many requests wait for room on a decode worker now; read at each
        scrape, from the scraping thread (so it must be a plain read, e.g. of an int)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests, by finish reason (stop, length, abort, error; none when there is none) "
            "and the gRPC status they ended with.", ["finish_reason", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens",
                                     "Prompt tokens of the requests that ran.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "Tokens returned to clients.", registry=r)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From a request's arrival to its first token reaching the router (completed "
            "requests).", buckets=LATENCY_S, registry=r)
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Per token after the first: the time since the tokens before it arrived (0 for "
            "tokens that arrived together, as from one DFLASH step).", buckets=TOKEN_GAP_S,
            registry=r)
        self.e2e_request_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "From a request's arrival to its last token (completed requests).",
            buckets=LATENCY_S, registry=r)
        self.running = Gauge(f"{PREFIX}_running_requests",
                             "Requests being run on workers now.", registry=r)
        self.waiting = Gauge(f"{PREFIX}_waiting_requests",
                             "Requests waiting for room on a decode worker now.", registry=r)
        if waiting is not None:
            self.waiting.set_function(lambda: float(waiting()))

    def rejected(self) -> None:
        """A request refused by the router's checks (INVALID_ARGUMENT)."""
        self.requests.labels(finish_reason=NO_FINISH, status="INVALID_ARGUMENT").inc()

    def ended(self, status: str, finish_reason: str | None, *, prompt_tokens: int,
              completion_tokens: int, time_to_first_token_s: float | None = None,
              inter_token_latencies_s: Sequence[float] = (),
              e2e_s: float | None = None) -> None:
        """A request that ran ended with gRPC status ``status`` (its name); its latencies are
        recorded when it completed (status OK)."""
        self.requests.labels(finish_reason=finish_reason or NO_FINISH, status=status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if status != "OK":
            return
        if time_to_first_token_s is not None:
            self.time_to_first_token.observe(time_to_first_token_s)
        for gap in inter_token_latencies_s:
            self.inter_token_latency.observe(gap)
        if e2e_s is not None:
            self.e2e_request_latency.observe(e2e_s)
