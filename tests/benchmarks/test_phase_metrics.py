"""benchmarks/phase_metrics.py: phase means from the differences of histogram sums and counts,
summed over every endpoint, read from a real registry served over HTTP."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from benchmarks.phase_metrics import PhaseScraper, read_histograms


@pytest.fixture
def endpoint():
    registry = CollectorRegistry()
    prefill = Histogram("flashsplit_prefill_prefill_time_seconds", "prefill", registry=registry)
    handoff = Histogram("flashsplit_prefill_handoff_time_seconds", "handoff", registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics", prefill, handoff
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_means_cover_only_the_requests_between_start_and_stop(endpoint):
    url, prefill, handoff = endpoint
    prefill.observe(10.0)  # before start: not counted
    scraper = PhaseScraper([url])
    scraper.start()
    for seconds in (0.1, 0.3):
        prefill.observe(seconds)
    handoff.observe(0.05)
    means = scraper.stop()
    assert means["prefill_s"] == pytest.approx(0.2)
    assert means["prefill_handoff_s"] == pytest.approx(0.05)
    assert means["prefill_queue_s"] is None and means["decode_handoff_s"] is None  # not served


def test_histograms_are_summed_over_endpoints(endpoint):
    url, prefill, _ = endpoint
    prefill.observe(0.5)
    one = read_histograms([url])["flashsplit_prefill_prefill_time_seconds"]
    both = read_histograms([url, url])["flashsplit_prefill_prefill_time_seconds"]
    assert one == pytest.approx((0.5, 1.0)) and both == pytest.approx((1.0, 2.0))
