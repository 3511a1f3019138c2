"""The CUDA-graph path of a tensor-parallel engine on the CPU: graph runners whose steps every
rank replays together (``common/parallel/follower_graphs.py``), in their uncaptured variant
(``capture=False``: the graphs' fixed buffers and padding, run eagerly), over gloo groups of 2
and 4 processes. Overlap scheduling's ids reach the followers by a broadcast from rank 0's
device buffer, as do a DFLASH block's drafts; both would give other tokens if a follower ran
with ids of its own, so equality with one process checks that path."""

from __future__ import annotations

import pytest

from common.engine.cuda_graph import CudaGraphConfig
from common.engine.factory import EngineSettings, build_engine
from common.engine.llm_engine import CacheConfig, EngineConfig
from common.engine.scheduler import SchedulerConfig
from common.model.forward_batch import ForwardMode
from common.parallel.follower_graphs import FollowerGraphs, ReplayGraph
from common.parallel.page_tables import FollowerTables, PagedRows
from common.parallel.launch import LocalGroup
from common.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [7] * 6]
PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.8, seed=5, max_new_tokens=24, ignore_eos=True)]
CACHE = CacheConfig(page_size=4, num_pages=96, num_slots=5)


def build(tp=None, draft: str | None = None):
    world = 1 if tp is None else tp.world_size
    engine = EngineConfig(cache=CACHE, scheduler=SchedulerConfig(max_prefill_tokens=8),
                          device="cpu", cuda_graph=CudaGraphConfig(capture=False))
    return build_engine(EngineSettings(model="tiny", engine=engine, tensor_parallel_size=world,
                                       draft=draft), tp=tp).engine


def counted(engine):
    """Count the engine's graph replays (decode and verify), overlapped launches and greedy
    commit graph runs."""
    counts = {"replays": 0, "launches": 0, "commits": 0}
    runners = [engine.runner.graphs]
    if engine.speculator is not None:
        runners.append(engine.speculator.verify_graphs)
    for runner in runners:
        replay = runner.replay

        def counting(*args, _replay=replay, **kwargs):
            counts["replays"] += 1
            return _replay(*args, **kwargs)
        runner.replay = counting
    if engine.overlap is not None:
        launch = engine.overlap.launch

        def counting_launch(*args, **kwargs):
            counts["launches"] += 1
            return launch(*args, **kwargs)
        engine.overlap.launch = counting_launch
    if engine.speculator is not None and engine.speculator.commit_graphs is not None:
        commit = engine.speculator.commit_graphs.run

        def counting_commit(*args, **kwargs):
            counts["commits"] += 1
            return commit(*args, **kwargs)
        engine.speculator.commit_graphs.run = counting_commit
    return counts


def run(engine, params=PARAMS):
    """Tokens, accept lengths and log-probabilities of PROMPTS; the pools end full again."""
    free = engine.load()
    reqs = engine.generate(PROMPTS, params)
    assert engine.load()["free_pages"] == free["free_pages"]
    assert engine.load()["free_slots"] == free["free_slots"]
    return [(r.output_ids, r.accept_lengths,
             [round(lp.logprob, 4) for lp in r.logprobs or []]) for r in reqs]


GREEDY = [PARAMS[0]] * len(PROMPTS)  # every step all greedy: the greedy commit graphs run


@pytest.fixture(scope="module")
def single():
    speculative = build(draft="tiny")
    return run(build()), run(speculative), run(speculative, GREEDY)


@pytest.mark.parametrize("world_size", [2, 4])
def test_graph_steps_of_a_sharded_engine_match_one_process(single, world_size):
    plain, speculative, greedy = single
    with LocalGroup(world_size, timeout_s=120) as tp:
        engine = build(tp)
        assert engine.runner.graphs.followers is not None and engine.overlap is not None
        counts = counted(engine)
        assert run(engine) == plain
        assert counts["replays"] > 0 and counts["launches"] > 0  # graphs and overlap ran
        engine = build(tp, draft="tiny")
        assert engine.speculator.verify_graphs.followers is not None
        counts = counted(engine)
        assert run(engine) == speculative
        assert counts["replays"] > 0  # the verify graphs ran on every rank
        assert run(engine, GREEDY) == greedy
        assert counts["commits"] > 0  # lengths broadcast from the commit graphs' device work


def test_a_follower_refuses_graph_messages_it_has_no_graphs_for():
    message = ReplayGraph(ForwardMode.DECODE, 1, [0], PagedRows([1], [1], {1: [1]}), [[5]])
    with pytest.raises(RuntimeError, match="no decode graphs"):
        FollowerGraphs().handle(message, None, None, None, FollowerTables())


CODE = ["def read_lines(path):\n    with open(path", "import os\nimport sys\n\n\ndef main(",
        "class Stack:\n    def __init__(self):\n        self."]


def test_a_trained_pairs_accepted_blocks_commit_alike_on_every_rank():
    """The built-in trained pair accepts more than one token per step, so the accepted lengths
    that reach the followers (from the greedy commit graphs' device work) decide what every
    rank's GDN state holds: at TP 2 the graph path gives the eager path's tokens and accept
    lengths, and one process's tokens. (Accept lengths may differ from one process's: the
    all-reduces' fp32 rounding reaches the draft's inputs, and a near-tie among its proposals
    can go the other way; greedy output cannot.)"""
    from common.tokenizer import load_tokenizer

    tok = load_tokenizer("pycoder")
    prompts = [tok.encode(text) for text in CODE]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)

    def build_pair(tp=None, graphs: bool = True):
        world = 1 if tp is None else tp.world_size
        engine = EngineConfig(cache=CACHE, scheduler=SchedulerConfig(max_prefill_tokens=8),
                              device="cpu",
                              cuda_graph=CudaGraphConfig(enabled=graphs, capture=False))
        return build_engine(EngineSettings(model="pycoder", engine=engine, draft="pycoder",
                                           tensor_parallel_size=world), tp=tp).engine

    def outputs(engine):
        free = engine.load()
        reqs = engine.generate(prompts, greedy)
        assert engine.load()["free_pages"] == free["free_pages"]
        return [(r.output_ids, r.accept_lengths) for r in reqs]

    single = outputs(build_pair())
    with LocalGroup(2, timeout_s=120) as tp:
        eager = outputs(build_pair(tp, graphs=False))
        engine = build_pair(tp)
        counts = counted(engine)
        graphed = outputs(engine)
    assert max(n for _, lengths in graphed for n in lengths) > 1  # blocks are accepted
    assert counts["commits"] > 0
    assert graphed == eager
    assert [tokens for tokens, _ in graphed] == [tokens for tokens, _ in single]
