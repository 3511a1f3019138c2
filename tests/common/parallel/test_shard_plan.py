"""common/parallel/shard_plan.py: which heads, columns and rows each rank holds; the refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.model.builtin import tiny_config
from common.model.family_registry import read_model_config
from common.model.loader import full_parameter_shapes
from common.parallel.shard_plan import ShardingError, ShardPlan, read_ranges, shard_heads
from tests.common.model.checkpoints import make_checkpoint


def test_heads_split_when_there_are_enough_groups():
    shards = [shard_heads("attention", 16, 4, r, 4) for r in range(4)]
    assert [s.heads for s in shards] == [range(4 * r, 4 * r + 4) for r in range(4)]
    assert [s.groups for s in shards] == [range(r, r + 1) for r in range(4)]


def test_a_group_is_replicated_when_there_are_fewer_groups_than_ranks():
    # Qwen3.5-35B-A3B's attention: 16 query heads reading 2 KV heads, at 8 ranks
    shards = [shard_heads("attention", 16, 2, r, 8) for r in range(8)]
    assert [s.heads for s in shards] == [range(2 * r, 2 * r + 2) for r in range(8)]
    assert [s.groups.start for s in shards] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(s.num_groups == 1 for s in shards)


@pytest.mark.parametrize("heads, groups, world, needs", [
    (16, 2, 3, "must divide 16"),
    (6, 3, 2, "must divide 3, or be a multiple of it"),
    (12, 4, 8, "must divide 12"),
    (24, 3, 4, "must be a multiple of 3"),
])
def test_an_impossible_split_says_what_must_divide(heads, groups, world, needs):
    with pytest.raises(ShardingError, match=needs):
        shard_heads("attention", heads, groups, 0, world)


def test_vocabulary_and_mlp_must_divide():
    config = tiny_config()
    ShardPlan.for_rank(config, 0, 2)
    with pytest.raises(ShardingError, match=r"vocab_size \(261\) cannot be split over 2"):
        ShardPlan.for_rank(replace(config, vocab_size=261), 0, 2)
    with pytest.raises(ShardingError, match="intermediate_size"):
        ShardPlan.for_rank(replace(config, intermediate_size=config.intermediate_size + 1), 0, 2)


def test_world_size_one_holds_everything():
    plan = ShardPlan.for_rank(tiny_config())
    assert not plan.is_sharded
    assert plan.ranges_of("model.layers.0.linear_attn.in_proj_qkv.weight") is None
    full = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(plan.take("lm_head.weight", full), full)


def test_gdn_conv_channels_follow_the_heads():
    c = tiny_config()
    plan = ShardPlan.for_rank(c, 1, 2)
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    g, h = plan.gdn.groups, plan.gdn.heads
    assert plan.gdn_conv_ranges() == (
        (g.start * dk, g.stop * dk),
        (c.key_dim + g.start * dk, c.key_dim + g.stop * dk),
        (2 * c.key_dim + h.start * dv, 2 * c.key_dim + h.stop * dv))
    assert plan.gdn_conv_dim == sum(b - a for a, b in plan.gdn_conv_ranges())


def test_read_ranges_concatenates_along_the_dim():
    full = torch.arange(24).reshape(2, 12)
    assert torch.equal(read_ranges(full, 1, ((0, 2), (6, 8))),
                       torch.cat([full[:, 0:2], full[:, 6:8]], dim=1))


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    return {kind: read_model_config(make_checkpoint(kind, root / kind))
            for kind in ("qwen3_5_text", "qwen3_next")}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_next"])
def test_every_rank_part_has_its_parameter_shape_and_split_parts_tile_the_whole(configs, kind,
                                                                               world):
    config = configs[kind]
    full_shapes = full_parameter_shapes(config)
    plans = [ShardPlan.for_rank(config, r, world) for r in range(world)]
    for name, shape in full_shapes.items():
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        parts = [plan.take(name, full) for plan in plans]
        spec = plans[0].ranges_of(name)
        if spec is None:
            assert all(torch.equal(p, full) for p in parts), name
            continue
        dim = spec[0]
        seen = torch.cat(parts, dim=dim)
        if "k_proj" in name or "v_proj" in name or "in_proj_qkv" in name or "conv1d" in name:
            # replicated KV / key heads appear once per rank that shares them
            assert set(seen.unique().tolist()) == set(full.unique().tolist()), name
        else:
            assert torch.equal(seen.sort(dim=dim).values, full.sort(dim=dim).values), name


def test_expert_parallel_places_whole_experts():
    config = replace(tiny_config(), num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=48,
                     decoder_sparse_step=1)
    plans = [ShardPlan.for_rank(config, r, 4, expert_parallel=True) for r in range(4)]
    assert [p.experts for p in plans] == [range(2 * r, 2 * r + 2) for r in range(4)]
    assert all(p.moe == range(32) and p.is_expert_parallel for p in plans)
    assert plans[1].ranges_of("model.layers.0.mlp.experts.down_proj") == (0, ((2, 4),))
    # the shared expert is still split by columns
    assert plans[1].shared_expert == range(12, 24)
    split = ShardPlan.for_rank(config, 1, 4)
    assert split.experts == range(8) and split.moe == range(8, 16)
    with pytest.raises(ShardingError, match=r"num_experts \(8\) cannot be split over 16"):
        ShardPlan.for_rank(config, 0, 16, expert_parallel=True)
    with pytest.raises(ValueError, match="needs routed experts"):
        ShardPlan.for_rank(tiny_config(), 0, 2, expert_parallel=True)
