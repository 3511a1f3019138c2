"""How a checkpoint tensor's name maps onto pieces of the model's parameters.

A *weight rule* looks at one checkpoint tensor name (after the family's prefix renames) and, when
the name is its own, returns the :class:`WeightPiece` list that tensor fills; ``None`` hands the
name on to the next rule. A family lists its rules (``ModelFamily.weight_rules``); a name that no
rule claims fills the parameter of the same name. The loader (``common/model/loader.py``) applies
the rules and checks that every parameter is covered exactly once.

A piece reads its content from a *source*: a safetensors slice (``get_slice``) or a tensor,
indexed with slices. Under tensor parallelism each rule reads only this rank's part of the
tensor (the :class:`~common.parallel.shard_plan.ShardPlan` it is given), so no rank reads the
full model; at world size 1 it reads the whole tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.config import ModelConfig
from common.parallel.shard_plan import ShardPlan, read_ranges

WHOLE = "whole"  # coverage key of a piece that fills its whole parameter

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor or parameter."""


@dataclass(frozen=True)
class WeightPiece:
    """One region of one parameter, filled from (a transform of) one checkpoint tensor."""

    param: str
    key: object  # coverage key: WHOLE, or (expert, part) for per-expert slices
    view: Callable[[torch.Tensor], torch.Tensor]  # parameter → the region it fills
    value: Callable[[object], torch.Tensor]  # checkpoint tensor's source → the region's content


# (name, full shape, config, this rank's shard plan) -> pieces, or None: not this rule's name
WeightRule = Callable[[str, tuple[int, ...], ModelConfig, ShardPlan], "list[WeightPiece] | None"]


def read_all(source) -> torch.Tensor:
    """All of a source (a safetensors slice or a tensor)."""
    return source[:]


def whole(param: str, value: Callable[[object], torch.Tensor] = read_all) -> WeightPiece:
    """A piece that fills all of ``param`` with ``value(source)``."""
    return WeightPiece(param, WHOLE, lambda p: p, value)


def sharded(param: str, plan: ShardPlan) -> WeightPiece:
    """A piece that fills all of ``param`` with this rank's part of the same-named tensor."""
    return whole(param, lambda source: plan.take(param, source))


def expect_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    """Raise WeightLoadError unless checkpoint tensor ``name`` has shape ``want``."""
    if tuple(got) != tuple(want):
        raise WeightLoadError(
            f"checkpoint tensor {name!r} has shape {list(got)}, expected {list(want)}")


def per_expert_slices(name: str, shape: tuple[int, ...], config: ModelConfig,
                      plan: ShardPlan) -> list[WeightPiece] | None:
    """``…mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`` into the packed experts:
    gate → ``gate_up_proj[e, :I]``, up → ``gate_up_proj[e, I:]``, down → ``down_proj[e]``
    (``I``: this rank's columns, ``plan.moe``: rows of gate and up, columns of down). With
    expert parallelism a rank reads only its own experts, whole, into its local index
    ``e - plan.experts.start``; another rank's expert fills nothing here and is not read."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    base, e, proj = m.group(1), int(m.group(2)), m.group(3)
    read = read_all
    if plan.is_expert_parallel:
        if e not in plan.experts:
            return []
        e -= plan.experts.start
    elif plan.is_sharded:
        # a rank reads only its columns: check the full size first, or a wrong-sized expert
        # would load a wrong part silently
        inter, hidden = config.moe_intermediate_size, config.hidden_size
        down = proj == "down_proj"  # [H, I]; gate and up are [I, H]
        expect_shape(name, shape, (hidden, inter) if down else (inter, hidden))
        columns = ((plan.moe.start, plan.moe.stop),)

        def read(source):
            return read_ranges(source, 1 if down else 0, columns)
    if proj == "down_proj":
        return [WeightPiece(f"{base}.down_proj", (e, "down"), lambda p: p[e], read)]
    # gate_up_proj rows [:I] are the gate, [I:] the up projection; I comes from the parameter so
    # that a wrong-sized expert tensor is a shape mismatch, not a partial fill
    if proj == "gate_proj":
        return [WeightPiece(f"{base}.gate_up_proj", (e, proj),
                            lambda p: p[e, : p.shape[1] // 2], read)]
    return [WeightPiece(f"{base}.gate_up_proj", (e, proj), lambda p: p[e, p.shape[1] // 2 :],
                        read)]
