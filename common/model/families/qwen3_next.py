"""Qwen3-Next: ``qwen3_next`` (a flat text config; no wrapper).

| checkpoint tensor                              | our parameter                            |
| ---------------------------------------------- | ---------------------------------------- |
| `mtp.*`, `model.mtp.*`                         | skipped (MTP draft head)                 |
| `…linear_attn.in_proj_qkvz.weight`             | `in_proj_qkv` + `in_proj_z`, regrouped   |
| `…linear_attn.in_proj_ba.weight`               | `in_proj_b` + `in_proj_a`, regrouped     |
| `…mlp.experts.{e}.gate_proj/up_proj/down_proj` | slices of the packed experts             |
| anything else                                  | the parameter of the same name           |
"""

from __future__ import annotations

import re

import torch

from common.config import ModelConfig
from common.model.families.family import ModelFamily
from common.model.qwen3_5 import HybridForCausalLM
from common.model.weight_rules import WeightPiece, expect_shape, per_expert_slices, whole
from common.parallel.shard_plan import ShardPlan

MODEL_TYPE = "qwen3_next"

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


FAMILY = ModelFamily(
    text_model_type=MODEL_TYPE,
    wrapper=Qwen3NextForCausalLM,
    # transformers' Qwen3NextConfig defaults
    defaults=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, rope_theta=10000.0,
        partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        decoder_sparse_step=1, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts_per_tok=10, num_experts=512, norm_topk_prob=True, rms_norm_eps=1e-6,
        full_attention_interval=4, tie_word_embeddings=False,
    ),
    skipped_prefixes=("mtp.", "model.mtp."),
    weight_rules=(split_qkvz, split_ba, per_expert_slices),
)
