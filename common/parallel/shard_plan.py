"""Which part of every weight and every cache a rank of a tensor-parallel group holds.

A :class:`ShardPlan` is pure data, computed from the model's config and the rank: it names each
rank's attention heads, GDN heads, MLP and expert columns and vocabulary rows, and for any of our
parameter names (docs/architecture.md) the ranges of the full tensor that rank holds
(:meth:`ShardPlan.ranges_of`). The model sizes its layers from it, the loader reads exactly those
ranges from safetensors, and the pools size their heads from it.

Routed experts are split one of two ways: inside each expert (every rank holds every expert's
part of the intermediate size), or, with ``expert_parallel``, whole experts per rank (each
rank holds ``num_experts / world_size`` of them).

Heads come in groups: attention query heads share a KV head (GQA), GDN value heads share a key
head. Query (value) heads are split evenly; KV (key) heads are split when there are at least as
many as ranks, and otherwise each rank keeps the one its query heads read, replicated on the
``world_size / num_groups`` ranks that share it. docs/tensor_parallel.md tabulates every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import ModelConfig

Ranges = tuple[tuple[int, int], ...]  # half-open [start, stop) ranges, concatenated in order


class ShardingError(ValueError):
    """The model cannot be split over this many ranks; the message says what must divide."""


@dataclass(frozen=True)
class HeadShard:
    """One rank's heads of a grouped-head layer: heads ``heads``, which read groups ``groups``
    (query heads and KV heads, or GDN value heads and key heads)."""

    heads: range
    groups: range

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def shard_heads(what: str, num_heads: int, num_groups: int, rank: int,
                world_size: int) -> HeadShard:
    """Rank ``rank``'s heads of ``num_heads`` heads in ``num_groups`` groups (head ``i`` reads
    group ``i // (num_heads // num_groups)``). Raises ShardingError when they cannot be split."""
    group_size = num_heads // num_groups
    if num_heads % world_size:
        raise ShardingError(f"{what}: {num_heads} heads cannot be split over {world_size} "
                            f"ranks (the tensor-parallel size must divide {num_heads})")
    per_rank = num_heads // world_size
    heads = range(rank * per_rank, (rank + 1) * per_rank)
    if num_groups >= world_size:
        if num_groups % world_size:
            raise ShardingError(f"{what}: {num_groups} groups cannot be split over "
                                f"{world_size} ranks (the tensor-parallel size must divide "
                                f"{num_groups}, or be a multiple of it)")
        per_rank = num_groups // world_size
        return HeadShard(heads, range(rank * per_rank, (rank + 1) * per_rank))
    if world_size % num_groups:
        raise ShardingError(f"{what}: {num_groups} groups cannot be replicated over "
                            f"{world_size} ranks (the tensor-parallel size must be a multiple "
                            f"of {num_groups}, or divide it)")
    group = heads.start // group_size
    return HeadShard(heads, range(group, group + 1))


def split_evenly(what: str, size: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s equal part of ``size`` (ShardingError unless it divides)."""
    if size % world_size:
        raise ShardingError(f"{what} ({size}) cannot be split over {world_size} ranks "
                            "(the tensor-parallel size must divide it)")
    part = size // world_size
    return range(rank * part, (rank + 1) * part)


def _scaled(r: range, unit: int, offset: int = 0) -> tuple[int, int]:
    return offset + r.start * unit, offset + r.stop * unit


def gdn_conv_channels(config: ModelConfig, gdn: HeadShard) -> Ranges:
    """The GDN conv channels (rows of ``in_proj_qkv``) of the heads ``gdn``: its key heads'
    q, its key heads' k, its value heads' v, in that order."""
    dk, dv, key_dim = config.linear_key_head_dim, config.linear_value_head_dim, config.key_dim
    return (_scaled(gdn.groups, dk), _scaled(gdn.groups, dk, key_dim),
            _scaled(gdn.heads, dv, 2 * key_dim))


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``world_size`` holds of a model (see the module docstring).

    Attributes:
        attention: query heads and KV heads of every full-attention layer.
        gdn: value heads and key heads of every GDN layer.
        mlp: columns of the dense MLP's intermediate size.
        experts: the routed experts this rank holds (all of them unless expert-parallel).
        moe: columns of the intermediate size of each expert it holds (all of them when
            expert-parallel).
        shared_expert: columns of the shared expert's intermediate size.
        vocab: rows of the embedding and the LM head.
    """

    config: ModelConfig
    rank: int
    world_size: int
    attention: HeadShard
    gdn: HeadShard
    mlp: range
    experts: range
    moe: range
    shared_expert: range
    vocab: range

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int = 0, world_size: int = 1, *,
                 expert_parallel: bool = False) -> "ShardPlan":
        """``expert_parallel``: whole routed experts per rank instead of a part of each.
        Raises ShardingError when ``world_size`` does not divide what it must, ValueError for
        expert parallelism on a model without experts."""
        c, n = config, world_size
        if not 0 <= rank < n:
            raise ValueError(f"rank {rank} is not in a group of {n}")
        has_dense = any(not c.is_moe_layer(i) for i in range(c.num_hidden_layers))
        has_moe = any(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
        if expert_parallel and not has_moe:
            raise ValueError(f"expert parallelism needs routed experts; this {c.model_type} "
                             "model has none")
        if expert_parallel:
            experts = split_evenly("num_experts", c.num_experts, rank, n)
            moe = range(c.moe_intermediate_size)
        else:
            experts = range(c.num_experts)
            moe = split_evenly("moe_intermediate_size", c.moe_intermediate_size if has_moe else 0,
                               rank, n)
        return cls(
            config=c, rank=rank, world_size=n,
            attention=shard_heads("attention", c.num_attention_heads, c.num_key_value_heads,
                                  rank, n),
            gdn=shard_heads("GDN", c.linear_num_value_heads, c.linear_num_key_heads, rank, n),
            mlp=split_evenly("intermediate_size", c.intermediate_size if has_dense else 0,
                             rank, n),
            experts=experts, moe=moe,
            shared_expert=split_evenly(
                "shared_expert_intermediate_size",
                c.shared_expert_intermediate_size if has_moe else 0, rank, n),
            vocab=split_evenly("vocab_size", c.vocab_size, rank, n))

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1

    @property
    def is_expert_parallel(self) -> bool:
        return len(self.experts) < self.config.num_experts

    # local sizes
    @property
    def gdn_key_dim(self) -> int:
        return self.gdn.num_groups * self.config.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn.num_heads * self.config.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def gdn_conv_ranges(self) -> Ranges:
        """This rank's channels of the GDN conv (and of ``in_proj_qkv``'s rows): its key
        heads' q, its key heads' k, its value heads' v."""
        return gdn_conv_channels(self.config, self.gdn)

    def ranges_of(self, param: str) -> tuple[int, Ranges] | None:
        """``(dim, ranges)``: the parts of full parameter ``param`` this rank holds, along
        ``dim``, concatenated in order; None when every rank holds all of it."""
        if not self.is_sharded:
            return None
        c, att, gdn = self.config, self.attention, self.gdn
        hd, dv = c.head_dim, c.linear_value_head_dim
        leaf = param.rsplit(".", 2)
        owner, name = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", param)
        if param in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, ((self.vocab.start, self.vocab.stop),)
        if ".self_attn." in param:
            return {
                "q_proj": (0, (_scaled(att.heads, 2 * hd),)),
                "k_proj": (0, (_scaled(att.groups, hd),)),
                "v_proj": (0, (_scaled(att.groups, hd),)),
                "o_proj": (1, (_scaled(att.heads, hd),)),
            }.get(owner)
        if ".linear_attn." in param:
            per_head = (0, (_scaled(gdn.heads, 1),))
            table = {
                "in_proj_qkv": (0, self.gdn_conv_ranges()),
                "conv1d": (0, self.gdn_conv_ranges()),
                "in_proj_z": (0, (_scaled(gdn.heads, dv),)),
                "in_proj_b": per_head, "in_proj_a": per_head,
                "out_proj": (1, (_scaled(gdn.heads, dv),)),
            }
            if owner == "linear_attn" and name in ("A_log", "dt_bias"):
                return per_head
            return table.get(owner)
        if ".mlp.experts." in param:
            if self.is_expert_parallel:  # [E, ...]: this rank's experts, whole
                return 0, ((self.experts.start, self.experts.stop),)
            moe, inter = self.moe, c.moe_intermediate_size
            if name == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
                return 1, ((moe.start, moe.stop), (inter + moe.start, inter + moe.stop))
            if name == "down_proj":  # [E, H, I]
                return 2, ((moe.start, moe.stop),)
            return None
        part = self.shared_expert if ".mlp.shared_expert." in param else self.mlp
        if ".mlp." in param and owner in ("gate_proj", "up_proj"):
            return 0, ((part.start, part.stop),)
        if ".mlp." in param and owner == "down_proj":
            return 1, ((part.start, part.stop),)
        return None  # norms, the router, the shared expert's gate: replicated

    def take(self, param: str, source) -> torch.Tensor:
        """This rank's part of full parameter ``param`` read from ``source``: a tensor, or a
        safetensors slice (``safe_open(...).get_slice(name)``), from which only those ranges
        are read."""
        spec = self.ranges_of(param)
        if spec is None:
            return source[:]
        return read_ranges(source, *spec)


def read_ranges(source, dim: int, ranges: Ranges) -> torch.Tensor:
    """The ``ranges`` of ``source`` along ``dim``, concatenated (one read per range)."""
    lead = (slice(None),) * dim
    parts = [source[lead + (slice(start, stop),)] for start, stop in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
