"""The decode worker's metrics (``flashsplit_decode_*``, docs/metrics.md).

Updated from the engine thread (tokens, finishes, DFLASH steps) and from the servicer on the
asyncio loop (handoffs); every prometheus_client update takes its own lock. Imports neither grpc
nor protobuf: the engine holds this object.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from common.metrics.buckets import BATCH, BYTES, LATENCY_S, STEP_S, accept_length_buckets
from common.metrics.samples import sample_total, sums_by_label
from common.metrics.worker_gauges import LoadSnapshot, WorkerGauges

PREFIX = "flashsplit_decode"
FINISH_REASONS = ("stop", "length", "abort", "error")
# handoff statuses that are not refusals: admitted, or given up by the sender
_NOT_REFUSED = ("OK", "CANCELLED")


class DecodeMetrics:
    """One decode worker's counters, histograms and gauges, in a registry of their own.

    The DFLASH metrics exist only on a worker with a draft (``block_size`` given).
    """

    def __init__(self, load: LoadSnapshot, block_size: int | None = None) -> None:
        """load: the engine's load snapshot (any thread), read by the gauges at each scrape;
        block_size: tokens per DFLASH step, None without a draft."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests that ended on this worker, by finish reason (stop, length, abort, error).",
            ["finish_reason"], registry=r)
        self.admitted = Counter(f"{PREFIX}_admitted_requests",
                                "Handed-off requests admitted into the running batch.",
                                registry=r)
        self.generated_tokens = Counter(
            f"{PREFIX}_generated_tokens",
            "Tokens emitted, each request's first (sampled on the prefill worker) included.",
            registry=r)
        self.handoffs = Counter(
            f"{PREFIX}_handoffs",
            "Handoffs taken, by the status they ended with (OK: admitted; CANCELLED: the "
            "sender gave up; any other: refused).", ["status"], registry=r)
        self.handoff_time = Histogram(
            f"{PREFIX}_handoff_time_seconds",
            "From a handoff's header (room reserved) to its admission: the prompt's prefill "
            "runs within it, its state streamed alongside.", buckets=LATENCY_S, registry=r)
        self.handoff_bytes = Histogram(
            f"{PREFIX}_handoff_bytes",
            "Payload bytes landed in the pools per handoff admitted (0 for pool copies).",
            buckets=BYTES,
            registry=r)
        self.step_requests = Histogram(
            f"{PREFIX}_step_requests",
            "Requests that got tokens in one engine step; its count is the steps run.",
            buckets=BATCH, registry=r)
        self.step_time = Histogram(
            f"{PREFIX}_step_time_seconds",
            "Wall time of one engine step that gave tokens, on the engine thread: its launch, "
            "the read of its tokens, and their hand-over to the streams. Against the time per "
            "output token a client sees, it tells the engine's part from the serving path's.",
            buckets=STEP_S, registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)  # present at 0 from the start
        self.handoffs.labels(status="OK")
        self.worker = WorkerGauges(PREFIX, r, load)
        self.block_size = block_size
        self.speculative = block_size is not None
        if self.speculative:
            self.spec_steps = Counter(
                f"{PREFIX}_spec_steps",
                "DFLASH steps, counted per request (a step of a batch of n counts n).",
                registry=r)
            self.spec_draft_tokens = Counter(
                f"{PREFIX}_spec_draft_tokens",
                "Draft tokens proposed (block_size - 1 per step).", registry=r)
            self.spec_accepted_tokens = Counter(
                f"{PREFIX}_spec_accepted_tokens", "Draft tokens accepted by verification.",
                registry=r)
            self.spec_accept_length = Histogram(
                f"{PREFIX}_spec_accept_length",
                "Tokens committed per DFLASH step: accepted drafts plus the bonus token.",
                buckets=accept_length_buckets(block_size), registry=r)
            self.spec_requests = Counter(
                f"{PREFIX}_spec_requests",
                "Handed-off requests admitted, by whether they decode with the draft (yes, "
                "no: they asked not to, or arrived past --speculative-disable-by-batch-size).",
                ["speculative"], registry=r)
            for answer in ("yes", "no"):
                self.spec_requests.labels(speculative=answer)

    # --- engine thread ---
    def admitted_request(self, speculative: bool = False) -> None:
        self.admitted.inc()
        if self.speculative:
            self.spec_requests.labels(speculative="yes" if speculative else "no").inc()

    def tokens_emitted(self, num_tokens: int) -> None:
        """Tokens left the engine (counted once per step: a decode step of a large batch
        emits hundreds)."""
        self.generated_tokens.inc(num_tokens)

    def engine_step(self, num_requests: int, seconds: float) -> None:
        """One engine step of ``seconds`` gave ``num_requests`` requests tokens."""
        self.step_requests.observe(num_requests)
        self.step_time.observe(seconds)

    def spec_step(self, accept_length: int) -> None:
        """A request's DFLASH step committed ``accept_length`` tokens."""
        if self.speculative:
            self.spec_steps.inc()
            self.spec_draft_tokens.inc(self.block_size - 1)
            self.spec_accepted_tokens.inc(accept_length - 1)
            self.spec_accept_length.observe(accept_length)

    def request_ended(self, finish_reason: str) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()

    # --- servicer ---
    def handoff_admitted(self, num_bytes: int, seconds: float) -> None:
        self.handoffs.labels(status="OK").inc()
        self.handoff_bytes.observe(num_bytes)
        self.handoff_time.observe(seconds)

    def handoff_ended(self, status: str) -> None:
        """A handoff ended without admission, with gRPC status ``status`` (its name)."""
        self.handoffs.labels(status=status).inc()

    def load_counters(self) -> dict[str, int]:
        """The totals ``GetLoad`` reports in ``LoadReport.counters``, under the names the
        router and tests read (docs/metrics.md). The ``spec_*`` ones only with a draft: the
        router takes their presence as "speculative decoding available"."""
        ended = sums_by_label(self.requests, f"{PREFIX}_requests_total", "finish_reason")
        handoffs = sums_by_label(self.handoffs, f"{PREFIX}_handoffs_total", "status")
        counters = {
            "admitted": sample_total(self.admitted, f"{PREFIX}_admitted_requests_total"),
            "finished": round(sum(v for k, v in ended.items() if k != "abort")),
            "aborted": round(ended.get("abort", 0.0)),
            "generated_tokens": sample_total(self.generated_tokens,
                                             f"{PREFIX}_generated_tokens_total"),
            "handoffs_received": round(handoffs.get("OK", 0.0)),
            "handoffs_refused": round(sum(v for k, v in handoffs.items()
                                          if k not in _NOT_REFUSED)),
            "handoff_bytes": sample_total(self.handoff_bytes, f"{PREFIX}_handoff_bytes_sum"),
        }
        if self.speculative:
            counters.update(
                spec_steps=sample_total(self.spec_steps, f"{PREFIX}_spec_steps_total"),
                spec_committed_tokens=sample_total(self.spec_accept_length,
                                                   f"{PREFIX}_spec_accept_length_sum"),
                spec_drafted_tokens=sample_total(self.spec_draft_tokens,
                                                 f"{PREFIX}_spec_draft_tokens_total"))
        return counters
