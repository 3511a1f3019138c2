"""A step that raises ends its own requests with "error" and frees them; the engine serves on."""

from __future__ import annotations

import pytest
import torch

from common.engine.errors import StepFailed, is_device_fault
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.model.load import load_model
from common.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def make_engine(model) -> LLMEngine:
    return LLMEngine(model, EngineConfig(cache=CacheConfig(page_size=4, num_pages=64,
                                                           num_slots=8)))


def free_counts(engine: LLMEngine) -> tuple[int, int]:
    return engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free


def test_a_failed_step_ends_only_its_requests_and_frees_them(model):
    engine = make_engine(model)
    before = free_counts(engine)
    expected = make_engine(model).generate([[5, 6, 7]], GREEDY)[0].output_ids
    engine.add_request([1, 2, 3, 4], GREEDY, request_id="victim")
    real_run = engine.runner.run

    def broken_run(step):
        raise ValueError("a kernel refused this batch")

    engine.runner.run = broken_run
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["victim"]
    assert isinstance(failed.value.__cause__, ValueError)
    assert "victim" not in engine.requests and free_counts(engine) == before
    engine.runner.run = real_run
    (survivor,) = engine.generate([[5, 6, 7]], GREEDY)
    assert survivor.output_ids == expected and free_counts(engine) == before


def test_a_failure_mid_decode_spares_requests_not_in_that_step(model):
    engine = make_engine(model)
    before = free_counts(engine)
    engine.add_request([1, 2, 3], GREEDY, request_id="a")
    engine.step()  # prefill of a; a decodes from here
    real_sample = engine.sampler.sample
    engine.sampler.sample = lambda *a, **k: (_ for _ in ()).throw(IndexError("bad row"))
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["a"]
    engine.sampler.sample = real_sample
    engine.add_request([9, 8], GREEDY, request_id="b")
    while engine.requests:
        engine.step()
    assert free_counts(engine) == before


def test_device_faults_stop_the_engine():
    assert is_device_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_fault(KeyboardInterrupt())
    assert not is_device_fault(ValueError("bad input"))
    assert not is_device_fault(RuntimeError("probability tensor contains either inf, nan"))
    if hasattr(torch, "AcceleratorError"):
        assert issubclass(torch.AcceleratorError, Exception)
