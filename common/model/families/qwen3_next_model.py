"""Qwen3-Next's model code (its declaration, with the table of its tensors, is
``qwen3_next.py``): the wrapper class and the weight rules that regroup its fused projections."""

from __future__ import annotations

import re

import torch

from common.config import ModelConfig
from common.model.families.qwen3_next import MODEL_TYPE
from common.model.qwen3_5 import HybridForCausalLM
from common.model.weight_rules import WeightPiece, expect_shape, per_expert_slices, whole
from common.parallel.shard_plan import ShardPlan

_QKVZ = re.compile(r"^(.*\.linear_attn)\.in_proj_qkvz\.weight$")
_BA = re.compile(r"^(.*\.linear_attn)\.in_proj_ba\.weight$")


class Qwen3NextForCausalLM(HybridForCausalLM):
    """Qwen3-Next text model: sparse layers every ``decoder_sparse_step``, dense where
    ``mlp_only_layers`` says."""

    model_types = (MODEL_TYPE,)


def _group_rows(source, plan: ShardPlan, rows_per_group: int, hidden: int) -> torch.Tensor:
    """This rank's key-head groups of an interleaved projection, ``[groups, rows, H]`` (one
    contiguous read: the checkpoint keeps each group's rows together)."""
    groups = plan.gdn.groups
    rows = source[groups.start * rows_per_group:groups.stop * rows_per_group]
    return rows.reshape(len(groups), rows_per_group, hidden)


def _own_value_heads(per_group: torch.Tensor, plan: ShardPlan, r: int) -> torch.Tensor:
    """This rank's value heads out of ``[groups, r, ...]`` (all r of each group when the key
    heads are split; a run of one group's when a key head is replicated)."""
    flat = per_group.reshape(-1, *per_group.shape[2:])
    first = plan.gdn.groups.start * r
    return flat[plan.gdn.heads.start - first:plan.gdn.heads.stop - first]


def split_qkvz(name: str, shape: tuple[int, ...], config: ModelConfig,
               plan: ShardPlan) -> list[WeightPiece] | None:
    """``in_proj_qkvz`` regrouped into our ``in_proj_qkv`` and ``in_proj_z``."""
    m = _QKVZ.match(name)
    if m is None:
        return None
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    dv, hidden = config.linear_value_head_dim, config.hidden_size
    r = config.linear_num_value_heads // hk
    # Qwen3-Next groups rows per k head g as [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)];
    # ours are q of all heads | k of all heads | v of all heads (value head j = g·r + i), and z.
    expect_shape(name, shape, (hk * (2 * dk + 2 * r * dv), hidden))

    def parts(source):
        grouped = _group_rows(source, plan, 2 * dk + 2 * r * dv, hidden)
        q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=1)
        v, z = (_own_value_heads(t.reshape(t.shape[0], r, dv, hidden), plan, r) for t in (v, z))
        return q, k, v, z

    def qkv(source):
        return torch.cat([x.reshape(-1, hidden) for x in parts(source)[:3]])

    return [whole(f"{m.group(1)}.in_proj_qkv.weight", qkv),
            whole(f"{m.group(1)}.in_proj_z.weight",
                  lambda source: parts(source)[3].reshape(-1, hidden))]


def split_ba(name: str, shape: tuple[int, ...], config: ModelConfig,
             plan: ShardPlan) -> list[WeightPiece] | None:
    """``in_proj_ba`` regrouped into our ``in_proj_b`` and ``in_proj_a``."""
    m = _BA.match(name)
    if m is None:
        return None
    hk, hidden = config.linear_num_key_heads, config.hidden_size
    r = config.linear_num_value_heads // hk
    # per k head g: [b_g (r) | a_g (r)]
    expect_shape(name, shape, (2 * hk * r, hidden))

    def part(source, i):
        grouped = _group_rows(source, plan, 2 * r, hidden).reshape(-1, 2, r, hidden)
        return _own_value_heads(grouped[:, i], plan, r)

    return [whole(f"{m.group(1)}.in_proj_{letter}.weight", lambda source, i=i: part(source, i))
            for i, letter in enumerate("ba")]


WRAPPER = Qwen3NextForCausalLM
WEIGHT_RULES = (split_qkvz, split_ba, per_expert_slices)
