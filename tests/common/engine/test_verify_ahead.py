"""The next step's verify launched ahead (``CudaGraphConfig.verify_ahead``: draft and verify of
step n+1 launched from step n's committed lengths on the device, before the host reads step n),
run eagerly on the CPU (``capture=False``): tokens and accept lengths equal those of steps
launched after the read, through batches that shrink, grow and pad, requests that join mid-way,
and one that asks for log-probabilities (which takes no verify ahead); nothing leaked. The
shipped trained pair in fp32 (``ahead_runs``)."""

from __future__ import annotations

import pytest

from tests.common.engine.ahead_runs import (BLOCK, CACHE, count_calls, eager_engine, fp32_pair,
                                          run_with_joins)


@pytest.fixture(scope="module")
def pair():
    return fp32_pair()


def _run(engine, logprobs: bool = False) -> tuple[list, dict]:
    """The requests of ``run_with_joins``, and how often each verify launch ran."""
    calls = count_calls(engine.speculator.verify_graphs, "run", "run_next")
    return run_with_joins(engine, logprobs), calls


def _same(got, want) -> None:
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in want]


def test_steps_verified_ahead_give_the_tokens_of_steps_after_the_read(pair):
    want, want_calls = _run(eager_engine(pair))
    engine = eager_engine(pair, verify_ahead=True)
    assert engine.speculator.draft_ahead  # a verify ahead needs its draft ahead
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    got, calls = _run(engine)
    _same(got, want)
    # steps of the same requests took the verify launched ahead; the batch's changes did not
    assert want_calls["run_next"] == 0 and calls["run_next"] > 5
    assert calls["run"] < want_calls["run"] - 5
    assert max(len(r.output_ids) for r in got) >= 10 * CACHE.page_size
    assert max(n for r in got for n in r.accept_lengths) > 2
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


def test_a_request_with_log_probabilities_verifies_after_the_read(pair):
    want, _ = _run(eager_engine(pair), logprobs=True)
    engine = eager_engine(pair, verify_ahead=True)
    got, calls = _run(engine, logprobs=True)
    _same(got, want)
    assert [r.logprobs for r in got] == [r.logprobs for r in want]
    assert got[-1].logprobs and calls["run_next"] > 0


def test_two_blocks_of_pages_are_reserved_past_the_cache(pair):
    plain, ahead = eager_engine(pair), eager_engine(pair, verify_ahead=True)
    assert plain.scheduler.config.lookahead_tokens == BLOCK
    assert ahead.scheduler.config.lookahead_tokens == 2 * BLOCK


def test_the_step_goes_ahead_where_the_attention_plans_on_the_device(pair, monkeypatch):
    """``step_ahead_if_planned`` (the workers' ``--speculative-ahead auto``): the whole next
    step where the verify's attention plans take lengths on the device, nothing ahead where
    they do not (a draft ahead alone is not timed as paying)."""
    from common.engine.cuda_graph import GraphRunner

    auto = eager_engine(pair, step_ahead_if_planned=True)
    assert auto.speculator.verify_graphs.plans_on_device
    assert auto.speculator.verify_ahead and auto.speculator.draft_ahead
    assert auto.scheduler.config.lookahead_tokens == 2 * BLOCK
    want, _ = _run(eager_engine(pair))
    got, calls = _run(auto)
    _same(got, want)
    assert calls["run_next"] > 5

    monkeypatch.setattr(GraphRunner, "plans_on_device", property(lambda self: False))
    host_planned = eager_engine(pair, step_ahead_if_planned=True)
    assert not (host_planned.speculator.verify_ahead or host_planned.speculator.draft_ahead)
    assert host_planned.scheduler.config.lookahead_tokens == BLOCK
