"""The next step's verify launched ahead (``CudaGraphConfig.verify_ahead``: draft and verify of
step n+1 launched from step n's committed lengths on the device, before the host reads step n),
run eagerly on the CPU (``capture=False``): tokens and accept lengths equal those of steps
launched after the read, through batches that shrink, grow and pad, requests that join mid-way,
and one that asks for log-probabilities (which takes no verify ahead); nothing leaked. The
shipped pycoder pair in fp32, so blocks are accepted to different lengths (an untrained draft's
are all 1, which a step moved by the wrong length would not show)."""

from __future__ import annotations

import pytest
import torch

from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.dflash import load_draft
from common.model.load import load_model
from common.sampling import SamplingParams
from common.tokenizer import load_tokenizer

CACHE = CacheConfig(page_size=4, num_pages=400, num_slots=12)
B = 8
CODE = ("def read_lines(path):\n    with open(path", "import os\n\ndef main(", "class Point:\n",
        "    for i in range(len(", "    return self.")


@pytest.fixture(scope="module")
def pair():
    model = load_model("pycoder", dtype=torch.float32)
    return model, load_draft("pycoder", model)


def _engine(pair, **ahead: bool) -> LLMEngine:
    model, draft = pair
    config = EngineConfig(cache=CACHE, cuda_graph=CudaGraphConfig(capture=False, **ahead),
                          scheduler=SchedulerConfig(max_running_requests=11))
    return LLMEngine(model, config, draft=draft, block_size=B)


def _prompts(first: int, n: int) -> list[list[int]]:
    tokenizer = load_tokenizer("pycoder")
    return [tokenizer.encode(p) for p in CODE[first:first + n]]


def _run(engine: LLMEngine, logprobs: bool = False) -> tuple[list, dict]:
    """Three requests, then two more once the first have taken a few steps; the requests, and
    how often each verify launch ran."""
    graphs = engine.speculator.verify_graphs
    calls = {"run": 0, "run_next": 0}
    for name in calls:
        fn = getattr(graphs, name)
        setattr(graphs, name,
                lambda *a, _fn=fn, _name=name, **k: (calls.__setitem__(_name, calls[_name] + 1),
                                                     _fn(*a, **k))[1])
    first = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n,
                                                  ignore_eos=True))
             for p, n in zip(_prompts(0, 3), (40, 14, 25))]
    for _ in range(4):
        engine.step()
    later = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n,
                                                  ignore_eos=True,
                                                  logprobs=1 if logprobs and i else None))
             for i, (p, n) in enumerate(zip(_prompts(3, 2), (30, 12)))]
    while engine.scheduler.num_requests:
        engine.step()
    return first + later, calls


def _same(got, want) -> None:
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in want]


def test_steps_verified_ahead_give_the_tokens_of_steps_after_the_read(pair):
    want, want_calls = _run(_engine(pair))
    engine = _engine(pair, verify_ahead=True)
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
    want, _ = _run(_engine(pair), logprobs=True)
    engine = _engine(pair, verify_ahead=True)
    got, calls = _run(engine, logprobs=True)
    _same(got, want)
    assert [r.logprobs for r in got] == [r.logprobs for r in want]
    assert got[-1].logprobs and calls["run_next"] > 0


def test_two_blocks_of_pages_are_reserved_past_the_cache(pair):
    plain, ahead = _engine(pair), _engine(pair, verify_ahead=True)
    assert plain.scheduler.config.lookahead_tokens == B
    assert ahead.scheduler.config.lookahead_tokens == 2 * B
