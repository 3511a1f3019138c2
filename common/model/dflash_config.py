"""Architecture of a DFLASH draft model, read from a z-lab-format ``config.json`` and checked
against the target it will draft for.

The draft is a stack of Qwen3 decoder layers (plain ``x̂·w`` RMSNorms, q/k norm, full-head-dim
RoPE) with no embedding or head of its own; ``fc`` fuses the target's captured hidden states
(docs/speculative.md, /work/shared/reference/dflash.md §1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError, ModelConfig

DRAFT_ARCHITECTURE = "DFlashDraftModel"
FULL, SLIDING = "full_attention", "sliding_attention"

# transformers' Qwen3Config defaults, used where a draft config omits a field
_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, hidden_act="silu",
                 block_size=16)


class DraftConfigError(ConfigError):
    """A draft checkpoint that does not fit this engine or its target, with the reason."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default capture layers when a config gives none: ``[N // 2]`` for one draft
    layer, else ``L`` ids spread evenly over ``1 .. N-3`` (N=36, L=5 -> [1, 9, 17, 25, 33])."""
    if num_draft_layers < 1:
        raise DraftConfigError(f"a draft needs at least one layer, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    """A DFLASH draft's architecture (immutable), already checked against its target.

    ``layer_types[i]`` is ``"full_attention"`` (non-causal over context + block unless
    ``is_causal`` says otherwise) or ``"sliding_attention"`` (causal and windowed to
    ``sliding_window`` positions, the current one included, unless ``is_causal`` is False).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    is_causal: bool | None
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    dtype: str = "float32"
    raw: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def num_context_features(self) -> int:
        """K: how many target layers feed ``fc`` (``fc.weight`` is ``[H, K*H]``)."""
        return len(self.target_layer_ids)

    def layer_is_causal(self, i: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == SLIDING

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    @classmethod
    def from_dict(cls, cfg: dict, *, target: ModelConfig) -> "DFlashConfig":
        """Parse a draft ``config.json`` dict for ``target``; DraftConfigError says what is wrong.

        Nested ``dflash_config`` fields win over top-level ones (``block_size`` moved there in
        newer checkpoints).
        """
        archs = cfg.get("architectures")
        if archs and DRAFT_ARCHITECTURE not in archs:
            raise DraftConfigError(f"architectures {archs} is not a DFLASH draft; expected "
                                   f"[{DRAFT_ARCHITECTURE!r}]")
        nested = dict(cfg.get("dflash_config") or {})

        def get(name, default=None):
            value = nested.get(name, cfg.get(name))
            return default if value is None else value

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size"):
            if cfg.get(name) is None:
                raise DraftConfigError(f"draft config has no {name!r}")
        hidden, num_layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise DraftConfigError(f"num_attention_heads {heads} is not a multiple of "
                                   f"num_key_value_heads {kv_heads}")
        if head_dim % 2:
            raise DraftConfigError(f"head_dim {head_dim} must be even for RoPE")
        if hidden != target.hidden_size:
            raise DraftConfigError(
                f"draft hidden_size {hidden} differs from the target's hidden_size "
                f"{target.hidden_size}: the draft reads the target's embeddings and hidden states")
        act = cfg.get("hidden_act", _DEFAULTS["hidden_act"])
        if act != "silu":
            raise DraftConfigError(f"hidden_act {act!r} is not supported (only silu)")

        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise DraftConfigError(f"draft rope_type {rope_type!r} is not supported (only "
                                   "default RoPE)")
        rope_theta = float(rope.get("rope_theta") or cfg.get("rope_theta")
                           or _DEFAULTS["rope_theta"])

        layer_types = tuple(cfg.get("layer_types") or (FULL,) * num_layers)
        if len(layer_types) != num_layers:
            raise DraftConfigError(f"layer_types has {len(layer_types)} entries but "
                                   f"num_hidden_layers is {num_layers}")
        bad = sorted(set(layer_types) - {FULL, SLIDING})
        if bad:
            raise DraftConfigError(f"unknown draft layer types {bad}")
        # NOTE: the raw window is used even where use_sliding_window is false: transformers'
        # Qwen3Config would drop it, but it is the window the draft was trained with.
        window = get("swa_window_size") if cfg.get("sliding_window") is None \
            else cfg["sliding_window"]
        if SLIDING in layer_types and not window:
            raise DraftConfigError("sliding_attention layers need a positive sliding_window")
        is_causal = cfg.get("is_causal")

        ids = get("target_layer_ids")
        if ids is None:
            ids = build_target_layer_ids(int(cfg.get("num_target_layers")
                                             or target.num_hidden_layers), num_layers)
        ids = tuple(int(i) for i in ids)
        if not ids:
            raise DraftConfigError("target_layer_ids is empty")
        outside = [i for i in ids if not 0 <= i < target.num_hidden_layers]
        if outside:
            raise DraftConfigError(f"target_layer_ids {outside} are outside the target's layers "
                                   f"0..{target.num_hidden_layers - 1}")
        mask = get("mask_token_id")
        if mask is None:
            raise DraftConfigError("draft config has no dflash_config.mask_token_id")
        if not 0 <= int(mask) < target.vocab_size:
            raise DraftConfigError(f"mask_token_id {mask} is outside the target vocabulary "
                                   f"0..{target.vocab_size - 1}")
        block = int(get("block_size", _DEFAULTS["block_size"]))
        if block < 2:
            raise DraftConfigError(f"block_size {block} must be at least 2")
        softcap = get("final_logit_softcapping")
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or target.dtype)
        return cls(
            hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or _DEFAULTS["rms_norm_eps"]),
            rope_theta=rope_theta,
            attention_bias=bool(cfg.get("attention_bias", _DEFAULTS["attention_bias"])),
            layer_types=layer_types, sliding_window=int(window) if window else None,
            is_causal=None if is_causal is None else bool(is_causal),
            target_layer_ids=ids, mask_token_id=int(mask), block_size=block,
            input_embedding_scale=float(get("input_embedding_scale", 1.0)),
            output_multiplier=float(get("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            dtype=dtype.replace("torch.", ""), raw=cfg)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, target: ModelConfig) -> "DFlashConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise DraftConfigError(f"no config.json in {path}")
        return cls.from_dict(json.loads(file.read_text()), target=target)
