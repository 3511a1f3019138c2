"""Model architecture read from a checkpoint's own ``config.json``.

Supported ``model_type`` values: ``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text``, and the
wrappers ``qwen3_5`` / ``qwen3_5_moe`` whose text config sits under ``text_config``. Nothing here
hard-codes a released model's numbers: every field comes from the file or from transformers'
documented default for that model type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

TEXT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
WRAPPER_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

# transformers' defaults per model type, used only where a config omits a field.
_DEFAULTS = {
    "qwen3_next": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, rope_theta=10000.0,
        partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        decoder_sparse_step=1, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts_per_tok=10, num_experts=512, norm_topk_prob=True, rms_norm_eps=1e-6,
        full_attention_interval=4, tie_word_embeddings=False,
    ),
    "qwen3_5_text": dict(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, rope_theta=10000000.0,
        partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        rms_norm_eps=1e-6, full_attention_interval=4, tie_word_embeddings=False, num_experts=0,
    ),
    "qwen3_5_moe_text": dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, rope_theta=10000000.0, partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256,
        rms_norm_eps=1e-6, full_attention_interval=4, tie_word_embeddings=False,
    ),
}


class ConfigError(ValueError):
    """A checkpoint config that this engine cannot serve, with the reason."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3.5 / Qwen3-Next hybrid text model (immutable).

    ``layer_types[i]`` is ``"linear_attention"`` (a Gated DeltaNet layer) or ``"full_attention"``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    is_wrapper: bool = False
    max_position_embeddings: int = 262144
    raw: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if bad:
            raise ConfigError(f"unknown layer types {bad}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and <= head_dim")

    # derived sizes
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.num_experts <= 0:
            return False
        if self.model_type == "qwen3_5_moe_text":
            return True
        return (layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    # loading
    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """Parse a ``config.json`` dict (flat text config or a wrapper with ``text_config``)."""
        model_type = cfg.get("model_type")
        is_wrapper = model_type in WRAPPER_MODEL_TYPES
        text = dict(cfg.get("text_config") or {}) if is_wrapper else dict(cfg)
        if is_wrapper:
            text.setdefault("model_type", WRAPPER_MODEL_TYPES[model_type])
            # small wrapper checkpoints keep tie_word_embeddings at the top level only
            if "tie_word_embeddings" not in text and "tie_word_embeddings" in cfg:
                text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
            for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
                if key not in text and key in cfg:
                    text[key] = cfg[key]
        text_type = text.get("model_type")
        if text_type not in TEXT_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; expected one of "
                f"{list(TEXT_MODEL_TYPES) + list(WRAPPER_MODEL_TYPES)}")
        merged = {**_DEFAULTS[text_type], **{k: v for k, v in text.items() if v is not None}}
        if text_type == "qwen3_5_text":
            merged["num_experts"] = 0

        rope = merged.get("rope_parameters") or merged.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", merged.get("rope_theta"))
        partial = rope.get("partial_rotary_factor", merged.get("partial_rotary_factor"))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only default RoPE)")

        num_layers = int(merged["num_hidden_layers"])
        layer_types = merged.get("layer_types")
        if not layer_types:
            interval = int(merged["full_attention_interval"])
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                           for i in range(num_layers)]
        eos = merged.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        dtype = str(merged.get("dtype") or merged.get("torch_dtype") or "float32")
        return cls(
            model_type=text_type,
            vocab_size=int(merged["vocab_size"]),
            hidden_size=int(merged["hidden_size"]),
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=int(merged["num_attention_heads"]),
            num_key_value_heads=int(merged["num_key_value_heads"]),
            head_dim=int(merged["head_dim"]),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            linear_num_key_heads=int(merged["linear_num_key_heads"]),
            linear_num_value_heads=int(merged["linear_num_value_heads"]),
            linear_key_head_dim=int(merged["linear_key_head_dim"]),
            linear_value_head_dim=int(merged["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(merged["linear_conv_kernel_dim"]),
            intermediate_size=int(merged.get("intermediate_size") or 0),
            num_experts=int(merged.get("num_experts") or 0),
            num_experts_per_tok=int(merged.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(merged.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(merged.get("shared_expert_intermediate_size") or 0),
            # Qwen3.5-MoE dropped the field and always renormalises the top-k weights.
            norm_topk_prob=bool(merged.get("norm_topk_prob", True)),
            decoder_sparse_step=int(merged.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(merged.get("mlp_only_layers") or ()),
            rms_norm_eps=float(merged["rms_norm_eps"]),
            tie_word_embeddings=bool(merged.get("tie_word_embeddings", False)),
            dtype=dtype.replace("torch.", ""),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=merged.get("bos_token_id"),
            is_wrapper=is_wrapper,
            max_position_embeddings=int(merged.get("max_position_embeddings") or 262144),
            raw=cfg,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` from a checkpoint directory."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"no config.json in {path}")
        return cls.from_dict(json.loads(file.read_text()))
