"""Checkpoint (safetensors) → model parameters, one tensor at a time.

Each checkpoint tensor name is translated by the rules below into one or more pieces of our
parameters (names in docs/architecture.md); every piece is copied in place into the parameter.

| checkpoint tensor                                    | our parameter                            |
| ---------------------------------------------------- | ---------------------------------------- |
| `model.visual.*`, `visual.*`, `mtp.*`, `model.mtp.*` | skipped (vision tower, MTP draft head)   |
| `model.language_model.X` (Qwen3.5 wrapper)           | `model.X`, then the rules below          |
| `lm_head.weight` when tied                           | skipped: the embedding is the head       |
| `…linear_attn.in_proj_qkvz.weight` (Qwen3-Next)      | `in_proj_qkv` + `in_proj_z`, regrouped   |
| `…linear_attn.in_proj_ba.weight` (Qwen3-Next)        | `in_proj_b` + `in_proj_a`, regrouped     |
| `…mlp.experts.{e}.gate_proj.weight` [I, H]           | `…mlp.experts.gate_up_proj[e, :I]`       |
| `…mlp.experts.{e}.up_proj.weight` [I, H]             | `…mlp.experts.gate_up_proj[e, I:]`       |
| `…mlp.experts.{e}.down_proj.weight` [H, I]           | `…mlp.experts.down_proj[e]`              |
| anything else (incl. packed experts [E, 2I, H])      | the parameter of the same name           |

Every parameter must be covered exactly once: per-expert pieces are tracked one by one, so a
missing expert or a tensor that arrives twice (e.g. both `in_proj_qkvz` and `in_proj_qkv`) is an
error, as are unknown tensors and shape mismatches.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from common.config import ModelConfig
from common.progress import progress_bar

SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
WRAPPER_PREFIX = "model.language_model."
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QKVZ = re.compile(r"^(.*\.linear_attn)\.in_proj_qkvz\.weight$")
_BA = re.compile(r"^(.*\.linear_attn)\.in_proj_ba\.weight$")
_WHOLE = "whole"  # coverage key of a piece that fills its whole parameter


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor or parameter."""


@dataclass
class _Piece:
    """One region of one parameter, filled from (a transform of) one checkpoint tensor."""

    param: str
    key: object  # coverage key: _WHOLE, or (expert, part) for per-expert slices
    view: Callable[[torch.Tensor], torch.Tensor]  # parameter → the region it fills
    value: Callable[[torch.Tensor], torch.Tensor]  # checkpoint tensor → the region's content


def _whole(param: str, value=lambda t: t) -> _Piece:
    return _Piece(param, _WHOLE, lambda p: p, value)


def _route(name: str, shape: tuple[int, ...], config: ModelConfig) -> list[_Piece]:
    """The pieces that checkpoint tensor ``name`` (already prefix-translated) fills."""
    if m := _PER_EXPERT.match(name):
        base, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down_proj":
            return [_Piece(f"{base}.down_proj", (e, "down"), lambda p: p[e], lambda t: t)]
        # gate_up_proj rows [:I] are the gate, [I:] the up projection; I comes from the parameter
        # so that a wrong-sized expert tensor is a shape mismatch, not a partial fill
        if proj == "gate_proj":
            return [_Piece(f"{base}.gate_up_proj", (e, proj), lambda p: p[e, : p.shape[1] // 2],
                           lambda t: t)]
        return [_Piece(f"{base}.gate_up_proj", (e, proj), lambda p: p[e, p.shape[1] // 2 :],
                       lambda t: t)]

    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    dv = config.linear_value_head_dim
    r = config.linear_num_value_heads // hk
    if m := _QKVZ.match(name):
        # Qwen3-Next groups rows per k head g as [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)];
        # ours are q of all heads | k of all heads | v of all heads (value head j = g·r + i), and z.
        _expect_shape(name, shape, (hk * (2 * dk + 2 * r * dv), config.hidden_size))

        def parts(t):
            return t.reshape(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)

        def qkv(t):
            return torch.cat([x.reshape(-1, t.shape[-1]) for x in parts(t)[:3]])

        return [_whole(f"{m.group(1)}.in_proj_qkv.weight", qkv),
                _whole(f"{m.group(1)}.in_proj_z.weight",
                       lambda t: parts(t)[3].reshape(-1, t.shape[-1]))]
    if m := _BA.match(name):
        # per k head g: [b_g (r) | a_g (r)]
        _expect_shape(name, shape, (2 * hk * r, config.hidden_size))
        return [_whole(f"{m.group(1)}.in_proj_{part}.weight",
                       lambda t, i=i: t.reshape(hk, 2, r, -1)[:, i].reshape(hk * r, -1))
                for i, part in enumerate("ba")]
    return [_whole(name)]


def _expect_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise WeightLoadError(
            f"checkpoint tensor {name!r} has shape {list(got)}, expected {list(want)}")


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


def _iter_tensors(files: dict[Path, list[str]]
                  ) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, read) per tensor: each shard is opened once, and a tensor is read only when asked
    for, so skipped tensors (vision tower, MTP) cost no I/O and at most one is held at a time."""
    for file, names in files.items():
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            for name in names:
                if name not in keys:
                    raise WeightLoadError(f"checkpoint tensor {name!r} is not in {file.name}")
                yield name, lambda name=name: f.get_tensor(name)


def load_weights(params: dict[str, torch.Tensor], checkpoint_dir: str | Path, config: ModelConfig,
                 *, progress: bool = False) -> None:
    """Copy a safetensors checkpoint into ``params`` (``dict(model.named_parameters())``) in place.

    Tensors are converted to each parameter's dtype and device. Raises WeightLoadError for a
    tensor that maps to no parameter, a shape mismatch, a region filled twice, or a parameter left
    unfilled.
    """
    checkpoint_dir = Path(checkpoint_dir)
    files = _checkpoint_files(checkpoint_dir)
    # named_parameters() lists a tied head once (as the embedding); a dict built by hand may list
    # the same tensor under both names: then it is filled once, through the embedding.
    tied = config.tie_word_embeddings or (LM_HEAD in params and EMBED in params
                                          and params[LM_HEAD] is params[EMBED])
    covered: dict[str, set] = defaultdict(set)
    bar = progress_bar(sum(len(names) for names in files.values()), "Loading weights",
                       "tensor", enabled=progress)

    with torch.no_grad(), bar:
        for raw_name, read in _iter_tensors(files):
            bar.update()
            if raw_name.startswith(SKIP_PREFIXES):
                continue
            name = ("model." + raw_name[len(WRAPPER_PREFIX):]
                    if raw_name.startswith(WRAPPER_PREFIX) else raw_name)
            if tied and name == LM_HEAD:
                continue
            tensor = read()
            for piece in _route(name, tuple(tensor.shape), config):
                param = params.get(piece.param)
                if param is None:
                    target = "" if piece.param == raw_name else f" (as {piece.param!r})"
                    raise WeightLoadError(
                        f"unexpected checkpoint tensor {raw_name!r}{target}: the model has no such "
                        "parameter")
                done = covered[piece.param]
                if piece.key in done or _WHOLE in done or (piece.key == _WHOLE and done):
                    raise WeightLoadError(
                        f"duplicate checkpoint tensor {raw_name!r}: parameter {piece.param!r} "
                        f"{'' if piece.key == _WHOLE else f'piece {piece.key} '}is already loaded")
                try:
                    region = piece.view(param.data)
                except IndexError:
                    raise WeightLoadError(
                        f"checkpoint tensor {raw_name!r} does not fit parameter {piece.param!r} "
                        f"of shape {list(param.shape)}") from None
                value = piece.value(tensor)
                if value.shape != region.shape:
                    raise WeightLoadError(
                        f"checkpoint tensor {raw_name!r} gives shape {list(value.shape)} for "
                        f"parameter {piece.param!r}, which expects {list(region.shape)}")
                region.copy_(value)
                done.add(piece.key)

        if tied and LM_HEAD in params and _WHOLE in covered[EMBED]:
            # the head is the embedding; a model that keeps a separate tensor for it gets a copy
            if params[LM_HEAD] is not params[EMBED]:
                params[LM_HEAD].data.copy_(params[EMBED].data)
            covered[LM_HEAD].add(_WHOLE)

    missing = [detail for name, param in params.items()
               if (detail := _missing_detail(name, param, covered[name])) is not None]
    if missing:
        raise WeightLoadError(f"parameters not found in the checkpoint {checkpoint_dir}: {missing}")


def _missing_detail(name: str, param: torch.Tensor, done: set) -> str | None:
    """None when ``name`` is fully loaded, else how it is incomplete (for the error message)."""
    if _WHOLE in done:
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
