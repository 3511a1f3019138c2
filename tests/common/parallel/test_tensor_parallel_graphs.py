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
    """Count the engine's graph replays (decode and verify) and overlapped launches."""
    counts = {"replays": 0, "launches": 0}
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
    return counts


def run(engine):
    """Tokens, accept lengths and log-probabilities of PROMPTS; the pools end full again."""
    free = engine.load()
    reqs = engine.generate(PROMPTS, PARAMS)
    assert engine.load()["free_pages"] == free["free_pages"]
    assert engine.load()["free_slots"] == free["free_slots"]
    return [(r.output_ids, r.accept_lengths,
             [round(lp.logprob, 4) for lp in r.logprobs or []]) for r in reqs]


@pytest.fixture(scope="module")
def single():
    return run(build()), run(build(draft="tiny"))


@pytest.mark.parametrize("world_size", [2, 4])
def test_graph_steps_of_a_sharded_engine_match_one_process(single, world_size):
    plain, speculative = single
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


def test_a_follower_refuses_graph_messages_it_has_no_graphs_for():
    message = ReplayGraph(ForwardMode.DECODE, 1, [0], PagedRows([1], [1], {1: [1]}), [[5]])
    with pytest.raises(RuntimeError, match="no decode graphs"):
        FollowerGraphs().handle(message, None, None, None, FollowerTables())
