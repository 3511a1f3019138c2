"""On one GPU: a tensor-parallel follower's graph runner (``common/parallel/follower_graphs.py``),
built, captured and replayed from rank 0's messages, gives the logits of rank 0's own captured
graphs for the same rows. One GPU has no second rank, so NCCL inside the graphs is not run here
(``test_tensor_parallel_gpu.py`` does that on several GPUs); what runs is the follower's side of
the protocol with real captures."""

from __future__ import annotations

import pytest
import torch

from common.model.forward_batch import ForwardMode
from common.parallel.follower_graphs import CaptureGraphs, FollowerGraphs, MakeGraphs, ReplayGraph
from common.parallel.page_tables import FollowerTables, LeaderTables
from common.sampling import SamplingParams
from tests.common.engine.test_cuda_graph_gpu import _engine, _prompts, models  # noqa: F401

pytestmark = pytest.mark.gpu


def test_a_followers_captured_graphs_replay_rank_zeros_steps(models):  # noqa: F811
    model, _ = models
    engine = _engine(model, None, graphs=True)
    leader = engine.runner.graphs
    follower = FollowerGraphs()
    pools = (model, engine.kv_pool, engine.state_pool, FollowerTables())
    follower.handle(MakeGraphs(ForwardMode.DECODE, 1, leader.batch_sizes, True), *pools)
    follower.handle(CaptureGraphs(ForwardMode.DECODE, 1), *pools)

    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in _prompts()]
    while not all(r.output_ids for r in reqs):
        engine.step()
    starts = [r.num_cached for r in reqs]
    pages = [r.page_ids[:engine.kv_pool.pages_for(s + 1)] for r, s in zip(reqs, starts)]
    slots = [r.slot for r in reqs]
    tokens = [[r.output_ids[-1]] for r in reqs]
    pool = engine.state_pool
    saved = pool.conv[:, slots].clone(), pool.ssm[:, slots].clone()  # a decode step moves them

    out, _ = leader.replay(starts, pages, slots, tokens)
    want = out.logits.clone()
    pool.conv[:, slots], pool.ssm[:, slots] = saved
    rows = LeaderTables().rows(slots, [r.page_ids for r in reqs], pages)
    got, batch = follower.handle(ReplayGraph(ForwardMode.DECODE, 1, starts, rows, tokens), *pools)
    torch.cuda.synchronize()
    assert batch.num_requests == leader.padded_size(len(reqs))
    torch.testing.assert_close(got.logits, want, rtol=0, atol=0)
    for r in reqs:
        engine.abort(r.request_id)
