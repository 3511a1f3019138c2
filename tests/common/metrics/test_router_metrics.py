"""RouterMetrics: what each request's end adds, and one registry per object."""

from __future__ import annotations

from common.metrics.router_metrics import NO_FINISH, RouterMetrics
from tests.common.metrics.scrape import scrape_registry

P = "flashsplit_router"


def test_a_completed_request_counts_once_with_its_latencies():
    m = RouterMetrics()
    m.ended("OK", "length", prompt_tokens=7, completion_tokens=4, time_to_first_token_s=0.2,
            inter_token_latencies_s=(0.01, 0.0, 0.03), e2e_s=0.5)
    s = scrape_registry(m.registry)
    assert s.value(f"{P}_requests_total", finish_reason="length", status="OK") == 1
    assert s.value(f"{P}_prompt_tokens_total") == 7
    assert s.value(f"{P}_generation_tokens_total") == 4
    assert s.value(f"{P}_time_to_first_token_seconds_count") == 1
    assert abs(s.value(f"{P}_time_to_first_token_seconds_sum") - 0.2) < 1e-9
    assert s.value(f"{P}_inter_token_latency_seconds_count") == 3
    assert abs(s.value(f"{P}_inter_token_latency_seconds_sum") - 0.04) < 1e-9
    assert s.value(f"{P}_e2e_request_latency_seconds_count") == 1
    # the 0.2 s first token is in the 0.256 bucket and above, not in the 0.128 one
    assert s.value(f"{P}_time_to_first_token_seconds_bucket", le="0.128") == 0
    assert s.value(f"{P}_time_to_first_token_seconds_bucket", le="0.256") == 1
    assert s.types[f"{P}_time_to_first_token_seconds"] == "histogram"
    assert s.types[f"{P}_requests"] == "counter"


def test_failed_cancelled_and_rejected_requests_count_by_status_without_latencies():
    m = RouterMetrics()
    m.ended("UNAVAILABLE", None, prompt_tokens=3, completion_tokens=2)
    m.ended("CANCELLED", None, prompt_tokens=3, completion_tokens=0,
            time_to_first_token_s=0.1, e2e_s=0.4)
    m.rejected()
    s = scrape_registry(m.registry)
    assert s.value(f"{P}_requests_total", finish_reason=NO_FINISH, status="UNAVAILABLE") == 1
    assert s.value(f"{P}_requests_total", finish_reason=NO_FINISH, status="CANCELLED") == 1
    assert s.value(f"{P}_requests_total", finish_reason=NO_FINISH,
                   status="INVALID_ARGUMENT") == 1
    assert s.value(f"{P}_requests_total") == 3
    # only completed requests have latencies; tokens count for every request that ran
    assert s.value(f"{P}_time_to_first_token_seconds_count") == 0
    assert s.value(f"{P}_e2e_request_latency_seconds_count") == 0
    assert s.value(f"{P}_prompt_tokens_total") == 6
    assert s.value(f"{P}_generation_tokens_total") == 2


def test_gauges_follow_running_requests_and_the_dispatch_queue():
    queued = [0]
    m = RouterMetrics(waiting=lambda: queued[0])
    m.running.inc()
    m.running.inc()
    queued[0] = 5
    s = scrape_registry(m.registry)
    assert s.value(f"{P}_running_requests") == 2
    assert s.value(f"{P}_waiting_requests") == 5
    m.running.dec()
    queued[0] = 0
    s = scrape_registry(m.registry)
    assert (s.value(f"{P}_running_requests"), s.value(f"{P}_waiting_requests")) == (1, 0)


def test_two_routers_in_one_process_keep_their_own_counts():
    a, b = RouterMetrics(), RouterMetrics()  # a shared registry would refuse the second
    a.rejected()
    assert scrape_registry(a.registry).value(f"{P}_requests_total") == 1
    assert scrape_registry(b.registry).value(f"{P}_requests_total") == 0
