"""How a checkpoint tensor's name maps onto pieces of the model's parameters.

A *weight rule* looks at one checkpoint tensor name (after the family's prefix renames) and, when
the name is its own, returns the :class:`WeightPiece` list that tensor fills; ``None`` hands the
name on to the next rule. A family lists its rules (``ModelFamily.weight_rules``); a name that no
rule claims fills the parameter of the same name. The loader (``common/model/loader.py``) applies
the rules and checks that every parameter is covered exactly once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.config import ModelConfig

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
    value: Callable[[torch.Tensor], torch.Tensor]  # checkpoint tensor → the region's content


WeightRule = Callable[[str, tuple[int, ...], ModelConfig], "list[WeightPiece] | None"]


def whole(param: str, value: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
          ) -> WeightPiece:
    """A piece that fills all of ``param`` with ``value(tensor)``."""
    return WeightPiece(param, WHOLE, lambda p: p, value)


def expect_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    """Raise WeightLoadError unless checkpoint tensor ``name`` has shape ``want``."""
    if tuple(got) != tuple(want):
        raise WeightLoadError(
            f"checkpoint tensor {name!r} has shape {list(got)}, expected {list(want)}")


def per_expert_slices(name: str, shape: tuple[int, ...],
                      config: ModelConfig) -> list[WeightPiece] | None:
    """``…mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`` into the packed experts:
    gate → ``gate_up_proj[e, :I]``, up → ``gate_up_proj[e, I:]``, down → ``down_proj[e]``."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    base, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down_proj":
        return [WeightPiece(f"{base}.down_proj", (e, "down"), lambda p: p[e], lambda t: t)]
    # gate_up_proj rows [:I] are the gate, [I:] the up projection; I comes from the parameter so
    # that a wrong-sized expert tensor is a shape mismatch, not a partial fill
    if proj == "gate_proj":
        return [WeightPiece(f"{base}.gate_up_proj", (e, proj),
                            lambda p: p[e, : p.shape[1] // 2], lambda t: t)]
    return [WeightPiece(f"{base}.gate_up_proj", (e, proj), lambda p: p[e, p.shape[1] // 2 :],
                        lambda t: t)]
