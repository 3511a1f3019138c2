"""Scheduler bookkeeping: reservations, chunk budgets, and when it has nothing to do."""

from __future__ import annotations

import pytest

from common.engine.llm_engine import CacheConfig, make_pools
from common.engine.request import Request
from common.engine.scheduler import RequestTooLarge, Scheduler, SchedulerConfig
from common.model.forward_batch import ForwardMode
from common.model.load import load_model
from common.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def make(tiny, *, pages=9, slots=3, budget=6, **kw):
    kv, state = make_pools(tiny, CacheConfig(page_size=4, num_pages=pages, num_slots=slots),
                           "cpu")
    return Scheduler(SchedulerConfig(max_prefill_tokens=budget, **kw), kv, state)


def req(n_prompt, n_new=4, rid="r"):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_new_tokens=n_new))


def test_prompts_are_chunked_under_the_budget_and_continue_first(tiny):
    s = make(tiny, budget=6)
    a, b = req(10, rid="a"), req(3, rid="b")
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert step.mode == ForwardMode.EXTEND and step.requests == [a] and step.num_new_tokens == [6]
    a.num_cached += 6
    step = s.schedule()  # a continues first, then b takes what is left of the budget
    assert step.requests == [a, b] and step.num_new_tokens == [4, 2]


def test_reservation_covers_the_whole_budget_and_is_returned(tiny):
    s = make(tiny, pages=9, lookahead_tokens=2)
    r = req(5, n_new=6)
    s.add(r)
    s.schedule()
    assert len(r.page_ids) == 4  # 5 + 6 + 2 tokens in pages of 4
    assert s.kv_pool.allocator.num_free == 4
    s.release(r)
    s.release(r)  # idempotent
    assert s.kv_pool.allocator.num_free == 8 and s.state_pool.allocator.num_free == 2


def test_nothing_to_schedule_while_the_head_waits_for_room(tiny):
    s = make(tiny, pages=9, reserve_output_tokens=False)
    first, second = req(30, rid="1"), req(8, rid="2")
    s.add(first)
    s.add(second)
    assert s.can_schedule()
    step = s.schedule()
    assert step.requests == [first]
    first.num_cached = 30
    s.detach(first)  # held for handoff: keeps its 8 pages, leaves the batch
    assert not s.can_schedule() and s.schedule() is None  # the engine thread may sleep
    s.release(first)
    assert s.can_schedule()


def test_a_request_that_can_never_fit_is_refused(tiny):
    s = make(tiny, pages=5)
    with pytest.raises(RequestTooLarge, match="KV pages"):
        s.add(req(20, n_new=10))
