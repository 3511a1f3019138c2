"""The prefill engine thread: cancelled callers and failing requests never end it."""

from __future__ import annotations

import asyncio

import pytest

from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.handoff.layout import LayoutDescriptor
from common.model.load import load_model
from common.request_spec import RequestSpec
from common.sampling import SamplingParams
from prefill_service.engine import PrefillEngine, PrefillJob

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture
def engine(model):
    llm = LLMEngine(model, EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=64, num_slots=8), hold_after_prefill=True,
        scheduler=SchedulerConfig(max_prefill_tokens=3, reserve_output_tokens=False)))
    engine = PrefillEngine(llm, LayoutDescriptor.from_model(model.config, 4, model.dtype), "fp")
    engine.start()
    yield engine
    engine.stop()


def full(engine: PrefillEngine) -> bool:
    load = engine.load()
    return load["free_pages"] == load["total_pages"] and load["free_slots"] == load["total_slots"]


def job(handoff_id: int, n: int = 9) -> PrefillJob:
    return PrefillJob(handoff_id, RequestSpec("", tuple(range(1, n + 1)), GREEDY))


def test_cancelled_waiters_leave_the_engine_serving(engine):
    """Each await is cancelled the way a deadline cancels a servicer: the engine's future is
    cancelled under it, at every point of the prefill (queued, mid-chunk, done)."""

    async def cancel_after(handoff_id: int, delay: float) -> None:
        task = asyncio.ensure_future(asyncio.wrap_future(engine.submit(job(handoff_id))))
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if handoff_id % 2:
            # what the servicer does for a request not yet held; the even ones model the abort
            # arriving only after the engine has finished the prefill
            engine.abort(handoff_id)

    async def scenario() -> None:
        await asyncio.gather(*[cancel_after(i + 1, 0.0005 * i) for i in range(24)])

    asyncio.run(scenario())
    first_token = engine.submit(job(1000)).result(30).token_id  # still serving
    engine.release(1000).result(5)
    assert first_token >= 0 and engine.is_alive
    for _ in range(200):
        if full(engine):
            break
        engine.call(lambda: None).result(5)
    assert full(engine)


def test_a_request_whose_step_fails_gets_an_error_and_the_next_one_runs(engine):
    real_run = engine.engine.runner.run
    calls = []

    def fail_once(step, **kwargs):
        calls.append(step)
        if len(calls) == 1:
            raise ValueError("kernel refused the batch")
        return real_run(step, **kwargs)

    engine.call(setattr, engine.engine.runner, "run", fail_once).result(5)
    with pytest.raises(RuntimeError, match="prefill failed"):
        engine.submit(job(7)).result(30)
    first_token = engine.submit(job(8)).result(30).token_id
    engine.release(8).result(5)
    assert first_token >= 0 and engine.is_alive and full(engine)


def test_progress_reports_each_finished_page_then_the_final_state(engine):
    """Prompt of 9 tokens, pages of 4, chunks of 3: chunk 1 completes no page, chunk 2 the
    first, chunk 3 the prompt (its last page partly filled) and the state. Each is reported
    before its forward runs, with the forward's layer progress; the first token follows."""
    seen = []
    first_token = engine.submit(job(11), seen.append).result(30).token_id
    engine.release(11).result(5)
    assert [r.num_pages for r in seen] == [1, 3, 3]
    assert [r.first_token for r in seen] == [None, None, first_token]
    assert [r.final_states for r in seen] == [False, True, True]
    assert [r.layer_ready is not None for r in seen] == [True, True, False]
    assert all(r.layer_ready.wait(r.layer_ready.num_layers - 1, timeout_s=0) is None
               for r in seen[:2])  # their forwards ran to the end
    assert all(len(r.page_ids) >= 3 and r.slot is not None for r in seen)


def test_a_forward_that_fails_after_its_report_ends_the_reads_waiting_on_it(engine):
    """The report of a chunk goes out before its forward; when the forward raises, a reader
    waiting on one of its layers gets ForwardFailed (not a wait without end), the request
    fails, and its room comes back."""
    from common.engine.layer_progress import ForwardFailed

    real_forward = engine.engine.runner.forward
    calls = []

    def fail_at_layer_one(batch_args, *, after_layer=None, tables=None):
        calls.append(batch_args)
        if len(calls) == 1:  # chunk 1 (3 tokens) completes no page, so reports nothing
            return real_forward(batch_args, after_layer=after_layer, tables=tables)
        after_layer(0)
        raise ValueError("kernel refused the batch")

    engine.call(setattr, engine.engine.runner, "forward", fail_at_layer_one).result(5)
    seen = []
    with pytest.raises(RuntimeError, match="prefill failed"):
        engine.submit(job(21), seen.append).result(30)
    engine.call(setattr, engine.engine.runner, "forward", real_forward).result(5)
    assert seen and seen[0].layer_ready is not None
    assert seen[0].layer_ready.wait(0, timeout_s=0) is None  # queued before the failure
    with pytest.raises(ForwardFailed, match="kernel refused"):
        seen[0].layer_ready.wait(1, timeout_s=5)
    assert engine.is_alive and full(engine)
