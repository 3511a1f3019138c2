"""The draft graphs' proposals launched ahead (``CudaGraphConfig.draft_ahead``: the next step's
draft launched from the commit's bonus tokens and lengths on the device, before the host reads
the step), run eagerly on the CPU (``capture=False``): every step's proposals equal those
launched after the read, through batches that shrink, grow and pad, contexts that cross pages,
and requests that join mid-way; tokens and accept lengths equal, nothing leaked. The shipped
pycoder pair in fp32, so blocks are accepted to different lengths (an untrained draft's are all
1, which a draft started at the wrong place would not show)."""

from __future__ import annotations

import pytest
import torch

from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.engine.speculative import _DraftAhead
from common.model.dflash import load_draft
from common.model.load import load_model
from common.sampling import SamplingParams
from common.tokenizer import load_tokenizer

CACHE = CacheConfig(page_size=4, num_pages=400, num_slots=12)
CODE = ("def read_lines(path):\n    with open(path", "import os\n\ndef main(", "class Point:\n",
        "    for i in range(len(", "    return self.")


@pytest.fixture(scope="module")
def pair():
    model = load_model("pycoder", dtype=torch.float32)
    return model, load_draft("pycoder", model)


def _engine(pair, ahead: bool) -> LLMEngine:
    model, draft = pair
    config = EngineConfig(cache=CACHE, cuda_graph=CudaGraphConfig(capture=False,
                                                                  draft_ahead=ahead),
                          scheduler=SchedulerConfig(max_running_requests=11))
    return LLMEngine(model, config, draft=draft, block_size=8)


def _prompts(first: int, n: int) -> list[list[int]]:
    tokenizer = load_tokenizer("pycoder")
    return [tokenizer.encode(p) for p in CODE[first:first + n]]


def _run(engine: LLMEngine) -> tuple[list, list, dict]:
    """Three requests, then two more once the first have taken a few steps; every step's
    proposals, the requests, and how often each draft launch ran."""
    spec = engine.speculator
    proposals, calls = [], {"run": 0, "run_next": 0}
    propose = spec.propose
    spec.propose = lambda reqs, pages: (lambda d: (proposals.append(d.clone()), d)[1])(
        propose(reqs, pages))
    for name in calls:
        fn = getattr(spec.draft_graphs, name)
        setattr(spec.draft_graphs, name,
                lambda *a, _fn=fn, _name=name, **k: (calls.__setitem__(_name, calls[_name] + 1),
                                                     _fn(*a, **k))[1])
    first = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n,
                                                  ignore_eos=True))
             for p, n in zip(_prompts(0, 3), (40, 14, 25))]
    for _ in range(4):
        engine.step()
    later = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n,
                                                  ignore_eos=True))
             for p, n in zip(_prompts(3, 2), (30, 12))]
    while engine.scheduler.num_requests:
        engine.step()
    return proposals, first + later, calls


def test_proposals_launched_ahead_equal_those_launched_after_the_read(pair):
    want_props, want_reqs, want_calls = _run(_engine(pair, ahead=False))
    engine = _engine(pair, ahead=True)
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    got_props, got_reqs, got_calls = _run(engine)
    assert len(got_props) == len(want_props)
    for step, (g, w) in enumerate(zip(got_props, want_props)):
        assert torch.equal(g, w), step
    assert [r.output_ids for r in got_reqs] == [r.output_ids for r in want_reqs]
    assert [r.accept_lengths for r in got_reqs] == [r.accept_lengths for r in want_reqs]
    # steps of the same requests took the draft launched ahead; the batch's changes did not
    assert want_calls["run_next"] == 0 and got_calls["run_next"] > 5
    assert got_calls["run"] < want_calls["run"] - 5
    # the longest request's context crossed ten pages while its drafts were launched ahead
    assert max(len(r.output_ids) for r in got_reqs) >= 10 * CACHE.page_size
    assert max(n for r in got_reqs for n in r.accept_lengths) > 2
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


class _Request:
    def __init__(self, num_cached: int, last: int) -> None:
        self.num_cached, self.output_ids = num_cached, [7, last]


def test_a_proposal_ahead_fits_only_the_rows_it_assumed():
    a, b = _Request(10, 3), _Request(20, 4)
    ahead = _DraftAhead((a, b), (10, 20), (3, 4), torch.zeros(2, 3))
    assert ahead.fits([a, b])
    assert not ahead.fits([b, a])  # another order
    assert not ahead.fits([a])  # a request left
    assert not ahead.fits([a, b, _Request(5, 1)])  # one joined
    b.num_cached = 12  # moved since (preempted and prefilled again, say)
    assert not ahead.fits([a, b])
    b.num_cached, b.output_ids[-1] = 20, 9  # its last token is not the bonus (a stop token)
    assert not ahead.fits([a, b])
