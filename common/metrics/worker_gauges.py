"""The gauges both workers read from their engine's load snapshot at each scrape."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Gauge

LoadSnapshot = Callable[[], Mapping[str, int]]

# metric name suffix, key in the engine's load snapshot (``LLMEngine.load``), help
_GAUGES = (
    ("running_requests", "running", "Requests in the running batch."),
    ("waiting_requests", "waiting", "Requests waiting to be scheduled."),
    ("kv_pages_free", "free_pages", "Free KV cache pages."),
    ("kv_pages_capacity", "total_pages", "Usable KV cache pages (the scratch page excluded)."),
    ("state_slots_free", "free_slots", "Free GDN state slots."),
    ("state_slots_capacity", "total_slots",
     "Usable GDN state slots (the scratch slot excluded)."),
)


class WorkerGauges:
    """``<prefix>_running_requests``, ``_waiting_requests``, ``_kv_pages_free`` /
    ``_capacity`` and ``_state_slots_free`` / ``_capacity``.

    Each is computed when scraped, from ``load()``, which must be safe to call from any thread
    (the metrics server's), as ``LLMEngine.load`` is: a gauge then never lags its engine.
    """

    def __init__(self, prefix: str, registry: CollectorRegistry, load: LoadSnapshot) -> None:
        self.gauges = {}
        for suffix, key, doc in _GAUGES:
            gauge = Gauge(f"{prefix}_{suffix}", doc, registry=registry)
            gauge.set_function(lambda key=key: float(load()[key]))
            self.gauges[suffix] = gauge
