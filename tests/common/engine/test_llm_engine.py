"""LLMEngine's request interface: what add_request and admit_prefilled refuse, what abort and
release free, held requests of a prefill engine, and a prefilled request continuing elsewhere."""

from __future__ import annotations

import pytest
import torch

from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine, warmup_groups
from common.model.load import load_model
from common.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
CACHE = CacheConfig(page_size=4, num_pages=32, num_slots=6)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def make_engine(model, **over) -> LLMEngine:
    return LLMEngine(model, EngineConfig(cache=CACHE, **over))


def free_counts(engine: LLMEngine) -> tuple[int, int]:
    return engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free


@pytest.mark.parametrize("prompt,match", [
    ([], "prompt is empty"),
    ([1, -1], "outside the vocabulary"),
    ([1, 10**9], "outside the vocabulary"),
])
def test_add_request_refuses_bad_prompts(model, prompt, match):
    engine = make_engine(model)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, GREEDY)
    assert not engine.requests and not engine.has_work()


def test_add_request_refuses_an_id_in_use_and_names_its_own(model):
    engine = make_engine(model)
    engine.add_request([1, 2], GREEDY, request_id="r")
    with pytest.raises(ValueError, match="'r' is already in use"):
        engine.add_request([3], GREEDY, request_id="r")
    a = engine.add_request([1], GREEDY)
    b = engine.add_request([1], GREEDY)
    assert a.request_id != b.request_id and len(engine.requests) == 3


def test_abort_frees_a_running_request_and_is_false_for_unknown_ids(model):
    engine = make_engine(model)
    before = free_counts(engine)
    engine.add_request([1, 2, 3], GREEDY, request_id="r")
    engine.step()
    assert free_counts(engine) != before
    assert engine.abort("r") is True
    assert free_counts(engine) == before and "r" not in engine.requests
    assert engine.abort("r") is False
    assert engine.abort("never") is False
    assert not engine.has_work()


def test_abort_of_a_waiting_request_before_any_step(model):
    engine = make_engine(model)
    req = engine.add_request([1, 2, 3], GREEDY, request_id="r")
    assert engine.abort("r") and req.finish_reason == "abort"
    assert engine.load()["waiting"] == 0 and not engine.has_work()


def test_a_held_request_keeps_its_cache_until_release(model):
    engine = make_engine(model, hold_after_prefill=True)
    before = free_counts(engine)
    engine.add_request([1, 2, 3, 4, 5], GREEDY, request_id="held")
    (event,) = engine.step()
    assert event.held and event.request_id == "held"
    assert not engine.has_work()  # nothing more to compute for it here
    assert free_counts(engine) != before
    engine.release("held")
    assert free_counts(engine) == before
    engine.release("held")  # a second release is harmless


def test_load_reports_free_and_total_capacity(model):
    engine = make_engine(model)
    load = engine.load()
    assert load["total_pages"] == CACHE.num_pages - 1 and load["total_slots"] == CACHE.num_slots - 1
    assert (load["free_pages"], load["free_slots"]) == (load["total_pages"], load["total_slots"])
    engine.add_request([1, 2], GREEDY)
    assert engine.load()["waiting"] == 1
    engine.step()
    load = engine.load()
    assert load["running"] == 1 and load["free_slots"] == load["total_slots"] - 1


def test_no_draft_means_no_speculation(model):
    engine = make_engine(model)
    assert not engine.wants_speculation(None) and not engine.wants_speculation(True)


def test_admit_prefilled_refusals(model):
    engine = make_engine(model)
    engine.add_request([1], GREEDY, request_id="taken")
    pages = engine.kv_pool.allocator.allocate(1)
    slot = engine.state_pool.allocate()
    with pytest.raises(ValueError, match="already in use"):
        engine.admit_prefilled("taken", [1, 2], 3, GREEDY, pages, slot)
    with pytest.raises(ValueError, match="needs an engine with a draft"):
        engine.admit_prefilled("new", [1, 2], 3, GREEDY, pages, slot, speculative=True)
    asks = SamplingParams(temperature=0.0, max_new_tokens=2, logprobs=2)
    with pytest.raises(ValueError, match="asks for log-probabilities"):
        engine.admit_prefilled("new", [1, 2], 3, asks, pages, slot)
    assert set(engine.requests) == {"taken"}


def test_a_prefilled_request_continues_as_if_it_never_moved(model):
    """Prefill on one engine, copy its pages and slot into another, admit it there: the tokens
    match one engine doing both, and abort gives the admitted room back."""
    prompt = [7, 3, 9, 1, 4, 4]
    (whole,) = make_engine(model).generate([prompt], GREEDY)

    prefill = make_engine(model, hold_after_prefill=True)
    req = prefill.add_request(prompt, GREEDY, request_id="r")
    (first,) = prefill.step()

    decode = make_engine(model)
    before = free_counts(decode)
    pages = decode.kv_pool.allocator.allocate(len(req.page_ids))
    slot = decode.state_pool.allocate()
    src, dst = torch.tensor(req.page_ids), torch.tensor(pages)
    decode.kv_pool.kv[:, dst] = prefill.kv_pool.kv[:, src]
    decode.state_pool.conv[:, slot] = prefill.state_pool.conv[:, req.slot]
    decode.state_pool.ssm[:, slot] = prefill.state_pool.ssm[:, req.slot]
    prefill.release("r")

    event = decode.admit_prefilled("r", prompt, first.token_id, GREEDY, pages, slot)
    assert event.token_id == whole.output_ids[0] and event.finish_reason is None
    tokens = [event.token_id]
    while decode.has_work():
        tokens += [e.token_id for e in decode.step() if e.request_id == "r"]
    assert tokens == whole.output_ids
    assert "r" not in decode.requests and free_counts(decode) == before


@pytest.mark.parametrize("room,sms,groups", [
    (5, None, [(0, 1), (1, 5)]),              # the CPU: one alone, then the rest
    (256, None, [(0, 1), (1, 8)]),
    (256, 132, [(0, 1), (1, 8), (8, 132)]),   # a GPU: then as many as it has SMs
    (40, 132, [(0, 1), (1, 8), (8, 40)]),     # no more than the engine holds
    (1, 132, [(0, 1)]),
])
def test_warmup_batches_cross_the_kernels_lines(room, sms, groups):
    assert warmup_groups(room, sms) == groups


def warmup_batches(engine: LLMEngine) -> list[tuple[str, int]]:
    """``engine.warmup()``'s forwards, as (mode, requests) each."""
    batches = []
    run = engine.runner.run

    def recording(step, **kwargs):
        batches.append((step.mode.name, len(step.requests)))
        return run(step, **kwargs)

    engine.runner.run = recording
    engine.warmup(progress=False)
    return batches


@pytest.mark.parametrize("hold", [False, True], ids=["local", "prefill worker"])
def test_warmup_on_a_gpu_also_prefills_as_many_prompts_as_it_has_sms(hold, monkeypatch):
    """The third group (here as if the GPU had 11 SMs) is prefilled in one step and ends at
    its first token: no decode step runs at its size."""
    cache = CacheConfig(page_size=4, num_pages=200, num_slots=12)
    engine = LLMEngine(load_model("tiny"), EngineConfig(cache=cache, hold_after_prefill=hold))
    monkeypatch.setattr(engine, "_sm_count", lambda: 11)
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    batches = warmup_batches(engine)
    assert [n for mode, n in batches if mode == "EXTEND"] == [1, 7, 3]
    assert max([0] + [n for mode, n in batches if mode == "DECODE"]) == (0 if hold else 8)
    assert not engine.requests and not engine.has_work()
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


@pytest.mark.parametrize("hold", [False, True], ids=["local", "prefill worker"])
def test_warmup_prefills_one_prompt_then_a_batch_and_gives_its_room_back(hold):
    engine = LLMEngine(load_model("tiny"), EngineConfig(cache=CACHE, hold_after_prefill=hold))
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    batches = warmup_batches(engine)
    # CACHE has 5 usable slots: one prompt alone (kernels take other variants for one
    # sequence), then a batch of the rest in one step
    extends = [n for mode, n in batches if mode == "EXTEND"]
    assert extends == [1, 4]
    assert hold or ("DECODE", 5) in batches
    assert not engine.requests and not engine.has_work()
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free
