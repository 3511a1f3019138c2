"""Pools sized for a tensor-parallel group on the CPU (a gloo group of 2 processes): rank 0
sizes them from ``--mem-fraction`` for every rank (each rank 1/N of the host), the followers
make pools of the same size after a profile on small ones, and the group then gives the
single-process tokens, its highest page included. Fixed sizes reach the followers the same way.
"""

from __future__ import annotations

import pytest

from common.cache.sizing import PoolRequest
from common.engine.factory import EngineSettings, build_engine
from common.engine.llm_engine import CacheConfig, EngineConfig
from common.engine.pool_sizing import host_figures, min_pages, pool_costs
from common.engine.scheduler import SchedulerConfig
from common.model.forward_batch import ForwardMode
from common.model.load import load_model
from common.parallel.launch import LocalGroup
from tests.common.parallel.test_tensor_parallel import GREEDY, PROMPTS

# a start-up pool far from the sized one, so a follower left on it would fail on a high page
ENGINE = EngineConfig(cache=CacheConfig(page_size=4, num_pages=80, num_slots=5),
                      scheduler=SchedulerConfig(max_prefill_tokens=8, max_running_requests=4))


def build(pools: PoolRequest, tp=None):
    world = 1 if tp is None else tp.world_size
    return build_engine(EngineSettings(model="tiny", engine=ENGINE, tensor_parallel_size=world,
                                       pools=pools), tp=tp)


def fraction_for(room_bytes: int) -> float:
    """A --mem-fraction that leaves each of 2 ranks about ``room_bytes`` for its pools."""
    figures = host_figures([load_model("tiny")], "cpu")
    return 2 * (figures.fixed_bytes + room_bytes) / figures.total_bytes


@pytest.fixture(scope="module")
def single_tokens():
    engine = build(PoolRequest(num_pages=400, num_slots=5, default_slots=5,
                               min_pages=min_pages(ENGINE))).engine
    return [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]


def test_mem_fraction_sizes_every_rank_alike(single_tokens):
    fraction = fraction_for(4 << 20)
    request = PoolRequest(mem_fraction=fraction, default_slots=5, min_pages=min_pages(ENGINE))
    with LocalGroup(2, timeout_s=120) as tp:
        built = build(request, tp)
        engine, sizing = built.engine, built.sizing
        figures, costs = sizing.figures, sizing.costs
        assert "1/2 of the host per rank" in sizing.describe()
        whole = host_figures([], "cpu").total_bytes
        assert figures.total_bytes == whole // 2
        # a rank's page holds half the KV heads, and its weights are its shard's
        full = pool_costs(load_model("tiny"), None, ENGINE.cache.page_size)
        assert costs.page_bytes * 2 == full.page_bytes
        assert figures.fixed_bytes < host_figures([load_model("tiny")], "cpu").fixed_bytes
        room = int(fraction * figures.total_bytes) - figures.fixed_bytes
        assert sizing.num_pages == (room - 5 * costs.slot_bytes) // costs.page_bytes
        assert engine.kv_pool.num_pages == sizing.num_pages
        assert engine.state_pool.num_slots == sizing.num_slots == 5
        free = engine.load()
        assert [r.output_ids for r in engine.generate(PROMPTS, GREEDY)] == single_tokens
        assert engine.load() == free
        _forward_on_the_last_page(engine)
        assert engine.load() == free


def test_fixed_pools_reach_the_followers(single_tokens):
    request = PoolRequest(num_pages=300, num_slots=5, default_slots=5,
                          min_pages=min_pages(ENGINE))
    with LocalGroup(2, timeout_s=120) as tp:
        engine = build(request, tp).engine
        assert engine.kv_pool.num_pages == 300
        assert [r.output_ids for r in engine.generate(PROMPTS, GREEDY)] == single_tokens
        _forward_on_the_last_page(engine)


def _forward_on_the_last_page(engine) -> None:
    """One prefill whose KV lands in the highest page of the pool, on every rank: a follower
    whose pools kept a smaller size (80 pages at start-up, then the profile's) would fail it."""
    kv, allocator = engine.kv_pool, engine.kv_pool.allocator
    held = allocator.allocate(allocator.num_free)  # the highest page comes out last
    last = held.pop()
    allocator.free(held)
    assert last == kv.num_pages - 1
    slot = engine.state_pool.allocate()
    try:
        out, _ = engine.runner.forward(dict(
            mode=ForwardMode.EXTEND, token_ids=[PROMPTS[1]], prefix_lens=[0],
            page_ids=[[last]], page_size=kv.page_size, state_slots=[slot],
            return_all_logits=True))
        assert out.logits.shape[0] == len(PROMPTS[1])
    finally:
        engine.state_pool.free(slot)
        allocator.free([last])
