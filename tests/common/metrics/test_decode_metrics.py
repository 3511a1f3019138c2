"""DecodeMetrics: finishes, handoffs, and the DFLASH metrics of a worker with a draft."""

from __future__ import annotations

import pytest

from common.metrics.decode_metrics import DecodeMetrics
from tests.common.metrics.scrape import scrape_registry

P = "flashsplit_decode"
LOAD = dict(running=1, waiting=0, free_pages=5, total_pages=9, free_slots=2, total_slots=3)


def test_finishes_aborts_and_handoffs_map_to_the_load_report_counters():
    m = DecodeMetrics(lambda: LOAD)
    m.admitted_request()
    m.tokens_emitted(1)
    m.tokens_emitted(2)
    m.request_ended("length")
    m.request_ended("error")
    m.request_ended("abort")
    m.handoff_admitted(1000, 0.01)
    m.handoff_ended("RESOURCE_EXHAUSTED")
    m.handoff_ended("DATA_LOSS")
    m.handoff_ended("CANCELLED")  # the sender gave up: not a refusal
    counters = m.load_counters()
    assert counters == {"admitted": 1, "finished": 2, "aborted": 1, "generated_tokens": 3,
                        "handoffs_received": 1, "handoffs_refused": 2, "handoff_bytes": 1000}
    s = scrape_registry(m.registry)
    assert s.value(f"{P}_requests_total", finish_reason="length") == 1
    assert s.value(f"{P}_requests_total", finish_reason="stop") == 0
    assert s.value(f"{P}_handoffs_total", status="RESOURCE_EXHAUSTED") == 1
    assert s.value(f"{P}_handoff_time_seconds_count") == 1
    assert not s.has(f"{P}_spec_steps_total")  # no draft, no DFLASH metrics


def test_dflash_steps_count_drafts_accepted_tokens_and_accept_lengths():
    m = DecodeMetrics(lambda: LOAD, block_size=4)
    m.tokens_emitted(1)  # the first token, from the prefill worker
    for accept_length in (4, 1, 2):  # one DFLASH step each
        m.spec_step(accept_length)
        m.tokens_emitted(accept_length)
    s = scrape_registry(m.registry)
    assert s.value(f"{P}_spec_steps_total") == 3
    assert s.value(f"{P}_spec_draft_tokens_total") == 3 * 3
    assert s.value(f"{P}_spec_accepted_tokens_total") == 3 + 0 + 1
    assert s.value(f"{P}_spec_accept_length_count") == 3
    assert s.value(f"{P}_spec_accept_length_sum") == 7
    # a bucket per possible length: le=1 holds the step that accepted nothing
    assert [s.value(f"{P}_spec_accept_length_bucket", le=le)
            for le in ("1.0", "2.0", "3.0", "4.0", "+Inf")] == [1, 2, 2, 3, 3]
    assert s.value(f"{P}_generated_tokens_total") == 1 + 7
    counters = m.load_counters()
    assert (counters["spec_steps"], counters["spec_committed_tokens"],
            counters["spec_drafted_tokens"]) == (3, 7, 9)


def test_admitted_requests_count_by_whether_they_speculate():
    m = DecodeMetrics(lambda: LOAD, block_size=4)
    s = scrape_registry(m.registry)
    assert s.value(f"{P}_spec_requests_total", speculative="no") == 0  # present from the start
    m.admitted_request(True)
    m.admitted_request(False)
    m.admitted_request(False)
    s = scrape_registry(m.registry)
    assert s.value(f"{P}_spec_requests_total", speculative="yes") == 1
    assert s.value(f"{P}_spec_requests_total", speculative="no") == 2
    assert s.value(f"{P}_admitted_requests_total") == 3


def test_engine_steps_count_steps_and_their_batches():
    m = DecodeMetrics(lambda: LOAD)
    for batch in (1, 3, 3, 16):
        m.engine_step(batch, 0.0005 * batch)
    s = scrape_registry(m.registry)
    assert s.value(f"{P}_step_time_seconds_count") == 4
    assert s.value(f"{P}_step_time_seconds_sum") == pytest.approx(0.0115)
    assert s.value(f"{P}_step_requests_count") == 4
    assert s.value(f"{P}_step_requests_sum") == 23
    assert [s.value(f"{P}_step_requests_bucket", le=le)
            for le in ("1.0", "2.0", "4.0", "8.0", "16.0")] == [1, 1, 3, 3, 4]
