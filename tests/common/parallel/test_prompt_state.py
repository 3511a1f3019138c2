"""common/parallel/prompt_state.py: a request's state split into the ranks' parts and put back
together is the full state (split and replicated heads), and through a real group of 4 (the
tiny model's 2 KV heads and 2 key heads replicated on 2 ranks each) the gathered state of a
prefill is the single-process one, and a scattered state gathers back exactly."""

from __future__ import annotations

import pytest
import torch

from common.engine.factory import EngineSettings, build_engine
from common.engine.llm_engine import CacheConfig, EngineConfig
from common.model.forward_batch import ForwardMode
from common.model.registry import load_config
from common.parallel import prompt_state
from common.parallel.launch import LocalGroup
from common.parallel.prompt_state import PromptState
from common.parallel.shard_plan import ShardPlan

CACHE = CacheConfig(page_size=4, num_pages=16, num_slots=4)
PROMPT = [(i * 7 + 3) % 256 for i in range(10)]  # three pages, the last one part-filled


def full_state(config, pages: int, dtype=torch.float32) -> PromptState:
    g = torch.Generator().manual_seed(0)
    layers_att = len(config.full_attention_layers)
    layers_gdn = len(config.linear_attention_layers)
    return PromptState(
        torch.randn(layers_att, pages, 2, 4, config.num_key_value_heads, config.head_dim,
                    generator=g).to(dtype),
        torch.randn(layers_gdn, 1, config.conv_dim, config.linear_conv_kernel_dim - 1,
                    generator=g).to(dtype),
        torch.randn(layers_gdn, 1, config.linear_num_value_heads, config.linear_value_head_dim,
                    config.linear_key_head_dim, generator=g))


@pytest.mark.parametrize("world_size", [2, 4])
def test_parts_assemble_into_the_full_state(world_size):
    config = load_config("tiny")
    full = full_state(config, pages=3, dtype=torch.bfloat16)
    plans = [ShardPlan.for_rank(config, r, world_size) for r in range(world_size)]
    parts = [prompt_state.take_part(p, full) for p in plans]
    # every rank holds as much as the next (what the byte-level gather and scatter rely on)
    assert len({prompt_state.pack(p).numel() for p in parts}) == 1
    zeros = PromptState(*(torch.zeros_like(t) for t in full.tensors))
    rebuilt = prompt_state.assemble(plans, [prompt_state.unpack(prompt_state.pack(p), p)
                                            for p in parts], zeros)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.tensors, full.tensors))
    if world_size == 4:  # one KV head per rank, replicated on ranks 0-1 and 2-3
        assert torch.equal(parts[0].kv, parts[1].kv) and not torch.equal(parts[1].kv,
                                                                          parts[2].kv)


def prefill(engine, pages, slot) -> None:
    engine.runner.forward(dict(mode=ForwardMode.EXTEND, token_ids=[PROMPT], prefix_lens=[0],
                               page_ids=[pages], page_size=CACHE.page_size,
                               state_slots=[slot]))


def build(tp=None):
    world = 1 if tp is None else tp.world_size
    return build_engine(EngineSettings(model="tiny", engine=EngineConfig(cache=CACHE),
                                       tensor_parallel_size=world), tp=tp).engine


def test_gather_and_scatter_over_a_group_of_four():
    single = build()
    pages, slot = [3, 1, 7], 2
    prefill(single, pages, slot)
    expected = prompt_state.read_from_pools(single.kv_pool, single.state_pool, pages, slot)
    with LocalGroup(4) as tp:
        engine = build(tp)
        link = engine.runner.followers
        prefill(engine, pages, slot)
        args = (engine.model, engine.kv_pool, engine.state_pool)
        gathered = link.gather_state(*args, pages, slot)
        for got, want in zip(gathered.tensors, expected.tensors):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        # the single-process state landed on other pages and slot comes back bit for bit
        other_pages, other_slot = [9, 2, 5], 3
        link.scatter_state(*args, other_pages, other_slot, expected)
        back = link.gather_state(*args, other_pages, other_slot)
        assert all(torch.equal(a, b) for a, b in zip(back.tensors, expected.tensors))
