"""PrefillMetrics: the load-report counters come from the same metrics a scrape reads."""

from __future__ import annotations

from common.metrics.prefill_metrics import PrefillMetrics
from tests.common.metrics.scrape import scrape_registry

P = "flashsplit_prefill"
LOAD = dict(running=2, waiting=3, free_pages=10, total_pages=40, free_slots=4, total_slots=8)


def test_engine_and_servicer_updates_reach_both_the_scrape_and_get_load():
    m = PrefillMetrics(lambda: LOAD)
    m.prompt_started(0.003)
    m.prompt_done(9, 0.05)
    m.prompt_started(0.001)
    m.prompt_aborted()
    m.answered("OK")
    m.answered("CANCELLED")
    m.handoff_sent(4096, 0.002, pool_copies=False, over_tcp=True, rank_streams=True)
    m.handoff_sent(0, 0.001, pool_copies=True)
    m.handoff_sent(100, 0.001, pool_copies=False, send_process=True)
    m.send_process_started()
    m.draft_context_declined()
    m.handoff_failed()
    s = scrape_registry(m.registry)
    assert s.value(f"{P}_queue_time_seconds_count") == 2
    assert s.value(f"{P}_prefill_time_seconds_count") == 1
    assert s.value(f"{P}_requests_total", status="OK") == 1
    assert s.value(f"{P}_requests_total", status="CANCELLED") == 1
    assert s.value(f"{P}_handoffs_total", result="sent") == 3
    assert s.value(f"{P}_handoff_bytes_count") == 3
    assert s.value(f"{P}_handoff_bytes_sum") == 4196
    assert s.value(f"{P}_handoff_time_seconds_count") == 3
    assert s.value(f"{P}_handoff_send_process_total") == 1
    assert s.value(f"{P}_send_process_starts_total") == 1
    assert s.value(f"{P}_draft_context_declined_total") == 1
    assert s.value(f"{P}_handoff_tcp_total") == 1
    assert s.value(f"{P}_handoff_rank_streams_total") == 1
    assert m.load_counters() == {
        "prefilled": 1, "prompt_tokens": 9, "aborted": 1, "handoffs_sent": 3,
        "handoffs_failed": 1, "handoff_bytes": 4196, "handoffs_as_pool_copies": 1,
        "handoffs_over_tcp": 1, "handoffs_over_rank_streams": 1,
        "handoffs_by_send_process": 1, "send_process_starts": 1, "draft_contexts_declined": 1}


def test_gauges_read_the_load_snapshot_at_each_scrape():
    load = dict(LOAD)
    m = PrefillMetrics(lambda: load)
    s = scrape_registry(m.registry)
    assert (s.value(f"{P}_running_requests"), s.value(f"{P}_waiting_requests")) == (2, 3)
    assert (s.value(f"{P}_kv_pages_free"), s.value(f"{P}_kv_pages_capacity")) == (10, 40)
    assert (s.value(f"{P}_state_slots_free"), s.value(f"{P}_state_slots_capacity")) == (4, 8)
    load.update(free_pages=40, running=0)
    s = scrape_registry(m.registry)
    assert (s.value(f"{P}_kv_pages_free"), s.value(f"{P}_running_requests")) == (40, 0)


def test_a_fresh_worker_reports_zeros_under_every_name():
    s = scrape_registry(PrefillMetrics(lambda: LOAD).registry)
    # the labelled counters show their usual series before anything happened
    assert s.label_values(f"{P}_handoffs_total", "result") == {"sent", "failed"}
    assert s.value(f"{P}_handoffs_total") == 0
    assert set(PrefillMetrics(lambda: LOAD).load_counters().values()) == {0}
