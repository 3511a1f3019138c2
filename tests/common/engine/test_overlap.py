"""Overlap scheduling on the CPU (the graph path's buffers run uncaptured): the same tokens as
steps run one at a time, for greedy and seeded sampling, with requests finishing, aborted and
arriving while a step is in flight, and nothing leaked."""

from __future__ import annotations

import pytest
import torch

from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.load import load_model
from common.sampling import SamplingParams

CACHE = CacheConfig(page_size=4, num_pages=300, num_slots=12)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def _engine(model, overlap: bool, draft=None) -> LLMEngine:
    return LLMEngine(model, EngineConfig(
        cache=CACHE, scheduler=SchedulerConfig(max_running_requests=11),
        cuda_graph=CudaGraphConfig(capture=False), overlap_schedule=overlap), draft=draft)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, 250, (3 + 2 * i,), generator=gen).tolist() for i in range(n)]


def _params(n: int) -> list[SamplingParams]:
    out = []
    for i in range(n):
        if i % 2:
            out.append(SamplingParams(temperature=0.9, top_k=20, seed=100 + i,
                                      max_new_tokens=4 + 3 * i, ignore_eos=True))
        else:
            out.append(SamplingParams(temperature=0.0, max_new_tokens=4 + 3 * i, ignore_eos=True))
    return out


def _free(engine):
    return engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free


def test_overlapped_steps_give_the_tokens_of_steps_in_turn(model):
    prompts, params = _prompts(7), _params(7)
    want = [r.output_ids for r in _engine(model, False).generate(prompts, params)]
    engine = _engine(model, True)
    assert engine.overlap is not None
    launches = []
    launch = engine.overlap.launch
    engine.overlap.launch = lambda reqs, sample: (launches.append(len(reqs)),
                                                  launch(reqs, sample))[1]
    free = _free(engine)
    got = engine.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    assert len(launches) > 10 and 7 in launches  # decode steps really went through launch
    engine.step()  # collects the extra step of the requests that finished last
    assert engine.overlap.in_flight is None and not engine.has_work()
    assert _free(engine) == free


def test_requests_arriving_and_aborted_while_a_step_is_in_flight(model):
    prompts, params = _prompts(6), _params(6)
    sync, engine = _engine(model, False), _engine(model, True)
    outputs = {}
    for eng in (sync, engine):
        free = _free(eng)
        first = [eng.add_request(p, sp) for p, sp in zip(prompts[:3], params[:3])]
        for _ in range(4):
            eng.step()
        late = [eng.add_request(p, sp) for p, sp in zip(prompts[3:], params[3:])]
        for _ in range(3):
            eng.step()
        eng.abort(first[2].request_id)
        while eng.has_work():
            eng.step()
        outputs[eng is engine] = [r.output_ids for r in first[:2] + late]
        assert _free(eng) == free
    assert outputs[True] == outputs[False]


def test_speculative_requests_run_in_turn(model):
    from common.model.dflash import load_draft

    draft = load_draft("tiny", model)
    prompts = _prompts(4)
    params = [SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)] * 4
    want = [r.output_ids for r in _engine(model, False).generate(prompts, params)]
    engine = _engine(model, True, draft=draft)
    got = engine.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    assert all(r.accept_lengths for r in got)
    assert engine.overlap.in_flight is None  # DFLASH steps never overlap


def test_overlap_needs_the_graph_runner(model):
    engine = LLMEngine(model, EngineConfig(cache=CACHE, overlap_schedule=True))
    assert engine.runner.graphs is None and engine.overlap is None
