"""The prefill worker's metrics (``flashsplit_prefill_*``, docs/metrics.md).

Updated from the engine thread (queue and prefill times, prompts) and from the servicer on the
asyncio loop (answers, handoffs); every prometheus_client update takes its own lock. Imports
neither grpc nor protobuf: the engine holds this object.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from common.metrics.buckets import BYTES, LATENCY_S
from common.metrics.samples import sample_total
from common.metrics.worker_gauges import LoadSnapshot, WorkerGauges

PREFIX = "flashsplit_prefill"


class PrefillMetrics:
    """One prefill worker's counters, histograms and gauges, in a registry of their own."""

    def __init__(self, load: LoadSnapshot) -> None:
        """load: the engine's load snapshot (any thread), read by the gauges at each scrape."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Prefill calls answered, by gRPC status.",
                                ["status"], registry=r)
        self.prompts = Counter(f"{PREFIX}_prompts", "Prompts prefilled to their first token.",
                               registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens prefilled.",
                                     registry=r)
        self.aborted = Counter(f"{PREFIX}_aborted_requests",
                               "Requests aborted before their prefill finished.", registry=r)
        self.queue_time = Histogram(
            f"{PREFIX}_queue_time_seconds",
            "From a prompt's submission to the engine to the first step that runs it.",
            buckets=LATENCY_S, registry=r)
        self.prefill_time = Histogram(
            f"{PREFIX}_prefill_time_seconds",
            "From the first step that runs a prompt to its first token (all its chunks).",
            buckets=LATENCY_S, registry=r)
        self.handoffs = Counter(f"{PREFIX}_handoffs",
                                "Handoffs to decode workers, by result (sent, failed).",
                                ["result"], registry=r)
        self.handoff_pool_copies = Counter(
            f"{PREFIX}_handoff_pool_copies",
            "Handoffs sent as pool-to-pool copies (the device transport).", registry=r)
        self.handoff_tcp = Counter(
            f"{PREFIX}_handoff_tcp",
            "Handoffs whose chunks went on a TCP connection beside the stream (the tcp "
            "transport).", registry=r)
        self.handoff_rank_streams = Counter(
            f"{PREFIX}_handoff_rank_streams",
            "Handoffs whose state went over per-rank streams, each rank sending its own heads "
            "(tensor parallelism).", registry=r)
        self.handoff_send_process = Counter(
            f"{PREFIX}_handoff_send_process",
            "Handoffs whose call the worker's send process wrote (--handoff-sender).",
            registry=r)
        self.send_process_starts = Counter(
            f"{PREFIX}_send_process_starts",
            "Starts of the worker's send process: more than one means it died and was started "
            "again.", registry=r)
        self.draft_declined = Counter(
            f"{PREFIX}_draft_context_declined",
            "Handoffs whose decode worker decodes the request without the draft: its draft "
            "context was neither made nor sent.", registry=r)
        self.handoff_time = Histogram(
            f"{PREFIX}_handoff_time_seconds",
            "From a prompt's first token to the decode worker's acknowledgement: the part of "
            "the handoff not hidden behind the prefill.", buckets=LATENCY_S, registry=r)
        self.handoff_bytes = Histogram(
            f"{PREFIX}_handoff_bytes",
            "Bytes written per handoff sent: its messages, framing included (0 for pool "
            "copies).", buckets=BYTES,
            registry=r)
        for result in ("sent", "failed"):
            self.handoffs.labels(result=result)  # present at 0 from the start
        self.requests.labels(status="OK")
        self.worker = WorkerGauges(PREFIX, r, load)

    # --- engine thread ---
    def prompt_started(self, queued_s: float) -> None:
        """The first step that runs a prompt began ``queued_s`` after its submission."""
        self.queue_time.observe(queued_s)

    def prompt_done(self, num_tokens: int, prefill_s: float) -> None:
        self.prompts.inc()
        self.prompt_tokens.inc(num_tokens)
        self.prefill_time.observe(prefill_s)

    def prompt_aborted(self) -> None:
        self.aborted.inc()

    # --- servicer ---
    def answered(self, status: str) -> None:
        """A Prefill call ended with gRPC status ``status`` (its name, e.g. "OK")."""
        self.requests.labels(status=status).inc()

    def handoff_sent(self, num_bytes: int, seconds: float, pool_copies: bool,
                     over_tcp: bool = False, rank_streams: bool = False,
                     send_process: bool = False) -> None:
        self.handoffs.labels(result="sent").inc()
        self.handoff_bytes.observe(num_bytes)
        self.handoff_time.observe(seconds)
        if pool_copies:
            self.handoff_pool_copies.inc()
        if over_tcp:
            self.handoff_tcp.inc()
        if rank_streams:
            self.handoff_rank_streams.inc()
        if send_process:
            self.handoff_send_process.inc()

    def send_process_started(self) -> None:
        self.send_process_starts.inc()

    def draft_context_declined(self) -> None:
        self.draft_declined.inc()

    def handoff_failed(self) -> None:
        self.handoffs.labels(result="failed").inc()

    def load_counters(self) -> dict[str, int]:
        """The totals ``GetLoad`` reports in ``LoadReport.counters``, under the names the
        router and tests read (docs/metrics.md)."""
        return {
            "prefilled": sample_total(self.prompts, f"{PREFIX}_prompts_total"),
            "prompt_tokens": sample_total(self.prompt_tokens, f"{PREFIX}_prompt_tokens_total"),
            "aborted": sample_total(self.aborted, f"{PREFIX}_aborted_requests_total"),
            "handoffs_sent": sample_total(self.handoffs, f"{PREFIX}_handoffs_total",
                                          {"result": "sent"}),
            "handoffs_failed": sample_total(self.handoffs, f"{PREFIX}_handoffs_total",
                                            {"result": "failed"}),
            "handoff_bytes": sample_total(self.handoff_bytes, f"{PREFIX}_handoff_bytes_sum"),
            "handoffs_as_pool_copies": sample_total(self.handoff_pool_copies,
                                                    f"{PREFIX}_handoff_pool_copies_total"),
            "handoffs_over_tcp": sample_total(self.handoff_tcp, f"{PREFIX}_handoff_tcp_total"),
            "handoffs_over_rank_streams": sample_total(
                self.handoff_rank_streams, f"{PREFIX}_handoff_rank_streams_total"),
            "handoffs_by_send_process": sample_total(
                self.handoff_send_process, f"{PREFIX}_handoff_send_process_total"),
            "send_process_starts": sample_total(
                self.send_process_starts, f"{PREFIX}_send_process_starts_total"),
            "draft_contexts_declined": sample_total(
                self.draft_declined, f"{PREFIX}_draft_context_declined_total"),
        }
