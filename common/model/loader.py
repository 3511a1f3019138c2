"""Checkpoint (safetensors) → model parameters, one tensor at a time.

Each checkpoint tensor name is translated by the model family's rules (``ModelFamily``: skipped
and renamed prefixes, then its weight rules, ``common/model/weight_rules.py``; each family module
under ``common/model/families/`` tabulates its own) into one or more pieces of our parameters
(names in docs/architecture.md); a name no rule claims fills the parameter of the same name, and a
tied checkpoint's ``lm_head.weight`` is skipped (the embedding is the head). Every piece is copied
in place into the parameter.

Every parameter must be covered exactly once: per-expert pieces are tracked one by one, so a
missing expert or a tensor that arrives twice (e.g. both `in_proj_qkvz` and `in_proj_qkv`) is an
error, as are unknown tensors and shape mismatches.

Tensors are opened as safetensors slices (``get_slice``) and each piece reads what it needs: the
whole tensor for an unsharded model, and under tensor parallelism only this rank's ranges
(``ShardPlan``), so no rank reads or holds the full model. A sharded tensor's full shape is
checked against the full model's before its ranges are read.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from common.config import ModelConfig
from common.model.family_registry import family_for
from common.model.weight_rules import (WHOLE, WeightLoadError, WeightPiece, WeightRule, sharded,
                                       whole)
from common.parallel.shard_plan import ShardPlan
from common.progress import progress_bar

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"



def _route(name: str, shape: tuple[int, ...], config: ModelConfig,
           rules: tuple[WeightRule, ...], plan: ShardPlan) -> list[WeightPiece]:
    """The pieces that checkpoint tensor ``name`` (already prefix-translated) fills."""
    for rule in rules:
        pieces = rule(name, shape, config, plan)
        if pieces is not None:
            return pieces
    return [sharded(name, plan) if plan.is_sharded else whole(name)]


def _checkpoint_files(checkpoint_dir: Path) -> dict[Path, list[str]]:
    """Shard file → tensor names in it (from the index's weight_map, or the single file's keys)."""
    index = checkpoint_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files: dict[Path, list[str]] = defaultdict(list)
        for name, shard in weight_map.items():
            files[checkpoint_dir / shard].append(name)
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{INDEX_FILE} names shard files that do not exist: {missing}")
        return {f: sorted(names) for f, names in sorted(files.items())}
    single = checkpoint_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {single: sorted(f.keys())}
    raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {checkpoint_dir}")


def _each_tensor(files: dict[Path, list[str]]) -> Iterator[tuple[str, object]]:
    """(name, the open shard holding it) per tensor, each shard opened once; a name the index
    places in a shard that lacks it is an error."""
    for file, names in files.items():
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            for name in names:
                if name not in keys:
                    raise WeightLoadError(f"checkpoint tensor {name!r} is not in {file.name}")
                yield name, f


def _iter_tensors(files: dict[Path, list[str]]
                  ) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, read) per tensor: a tensor is read only when asked for, so skipped tensors
    (vision tower, MTP) cost no I/O and at most one is held at a time."""
    for name, f in _each_tensor(files):
        yield name, lambda name=name, f=f: f.get_tensor(name)


class _ReadOnce:
    """A safetensors slice whose reads are kept while its tensor is being loaded: the pieces of
    one tensor (``in_proj_qkvz``'s qkv and z, say) often read the same rows."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.reads: dict[tuple, torch.Tensor] = {}

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        parts = index if isinstance(index, tuple) else (index,)
        key = tuple((p.start, p.stop, p.step) if isinstance(p, slice) else p for p in parts)
        if key not in self.reads:
            self.reads[key] = self.inner[index]
        return self.reads[key]


def _iter_slices(files: dict[Path, list[str]]) -> Iterator[tuple[str, object]]:
    """(name, safetensors slice) per tensor: nothing is read until a piece indexes the slice,
    and what was read is dropped when the next tensor comes."""
    for name, f in _each_tensor(files):
        yield name, _ReadOnce(f.get_slice(name))


def full_parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in the unsharded model (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = family_for(config.model_type).wrapper(config, dtype=torch.float32)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def load_weights(params: dict[str, torch.Tensor], checkpoint_dir: str | Path, config: ModelConfig,
                 *, plan: ShardPlan | None = None, progress: bool = False) -> None:
    """Copy a safetensors checkpoint into ``params`` (``dict(model.named_parameters())``) in place.

    ``plan``: the rank's shard plan of a tensor-parallel model (``model.shard_plan``); None or
    world size 1 loads whole tensors. Tensors are converted to each parameter's dtype and
    device. Raises WeightLoadError for a tensor that maps to no parameter, a shape mismatch, a
    region filled twice, or a parameter left unfilled.
    """
    checkpoint_dir = Path(checkpoint_dir)
    family = family_for(config.model_type)
    files = _checkpoint_files(checkpoint_dir)
    plan = plan or ShardPlan.for_rank(config)
    full_shapes = full_parameter_shapes(config) if plan.is_sharded else {}
    # named_parameters() lists a tied head once (as the embedding); a dict built by hand may list
    # the same tensor under both names: then it is filled once, through the embedding.
    tied = config.tie_word_embeddings or (LM_HEAD in params and EMBED in params
                                          and params[LM_HEAD] is params[EMBED])
    covered: dict[str, set] = defaultdict(set)
    bar = progress_bar(sum(len(names) for names in files.values()), "Loading weights",
                       "tensor", enabled=progress)

    rules = family.weight_rules  # from the family's model module: read once, not per tensor
    with torch.no_grad(), bar:
        for raw_name, source in _iter_slices(files):
            bar.update()
            name = family.checkpoint_name(raw_name)
            if name is None or (tied and name == LM_HEAD):
                continue
            shape = tuple(source.get_shape())
            if name in full_shapes and shape != full_shapes[name]:
                raise WeightLoadError(
                    f"checkpoint tensor {raw_name!r} has shape {list(shape)}, but parameter "
                    f"{name!r} of the full model is {list(full_shapes[name])}")
            for piece in _route(name, shape, config, rules, plan):
                param = params.get(piece.param)
                if param is None:
                    target = "" if piece.param == raw_name else f" (as {piece.param!r})"
                    raise WeightLoadError(
                        f"unexpected checkpoint tensor {raw_name!r}{target}: the model has no such "
                        "parameter")
                done = covered[piece.param]
                if piece.key in done or WHOLE in done or (piece.key == WHOLE and done):
                    raise WeightLoadError(
                        f"duplicate checkpoint tensor {raw_name!r}: parameter {piece.param!r} "
                        f"{'' if piece.key == WHOLE else f'piece {piece.key} '}is already loaded")
                try:
                    region = piece.view(param.data)
                except IndexError:
                    raise WeightLoadError(
                        f"checkpoint tensor {raw_name!r} does not fit parameter {piece.param!r} "
                        f"of shape {list(param.shape)}") from None
                value = piece.value(source)
                if value.shape != region.shape:
                    raise WeightLoadError(
                        f"checkpoint tensor {raw_name!r} gives shape {list(value.shape)} for "
                        f"parameter {piece.param!r}, which expects {list(region.shape)}")
                region.copy_(value)
                done.add(piece.key)

        if tied and LM_HEAD in params and WHOLE in covered[EMBED]:
            # the head is the embedding; a model that keeps a separate tensor for it gets a copy
            if params[LM_HEAD] is not params[EMBED]:
                params[LM_HEAD].data.copy_(params[EMBED].data)
            covered[LM_HEAD].add(WHOLE)

    missing = [detail for name, param in params.items()
               if (detail := _missing_detail(name, param, covered[name])) is not None]
    if missing:
        raise WeightLoadError(f"parameters not found in the checkpoint {checkpoint_dir}: {missing}")


def read_whole(checkpoint_dir: str | Path, config: ModelConfig,
               names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The whole tensors of our parameters ``names`` (their checkpoint tensors renamed by the
    family's prefixes, read as stored), for what must stay whole on one rank of a sharded
    model. Raises WeightLoadError when one is not in the checkpoint."""
    family = family_for(config.model_type)
    found: dict[str, torch.Tensor] = {}
    for raw_name, source in _iter_slices(_checkpoint_files(Path(checkpoint_dir))):
        name = family.checkpoint_name(raw_name)
        if name in names:
            found[name] = source[:]
    missing = [n for n in names if n not in found]
    if missing:
        raise WeightLoadError(f"{missing} not found in the checkpoint {checkpoint_dir}")
    return found


def _missing_detail(name: str, param: torch.Tensor, done: set) -> str | None:
    """None when ``name`` is fully loaded, else how it is incomplete (for the error message)."""
    if WHOLE in done:
        return None
    # packed experts may be filled piece by piece: every expert's gate and up (or down) slice
    if name.endswith(".mlp.experts.gate_up_proj"):
        parts = ("gate_proj", "up_proj")
    elif name.endswith(".mlp.experts.down_proj"):
        parts = ("down",)
    else:
        return name
    absent = [(e, p) for e in range(param.shape[0]) for p in parts if (e, p) not in done]
    if not absent:
        return None
    if len(absent) == len(parts) * param.shape[0]:
        return name
    base = name.rsplit(".", 1)[0]
    pieces = [f"{base}.{e}.{'down_proj' if p == 'down' else p}.weight" for e, p in absent]
    return f"{name} (no {', '.join(pieces[:4])}{', …' if len(pieces) > 4 else ''})"
