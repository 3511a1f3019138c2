"""Model architecture of a hybrid Gated-DeltaNet text model, and its parse from a flat dict.

Which ``model_type`` values exist, their defaults and their fixed choices belong to the model
families (``common/model/families/``); ``common/model/family_registry.py`` finds the family of a
``config.json`` and gives this module a flat dict with every field filled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


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
        return (layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    # loading
    @classmethod
    def from_fields(cls, model_type: str, merged: dict, *, is_wrapper: bool,
                    raw: dict) -> "ModelConfig":
        """Build from a flat text config whose family defaults are already merged in.

        ``merged`` must hold every field without a fallback here (sizes, head counts, RoPE
        theta); ``raw`` is the ``config.json`` dict as read, kept for reference only.
        """
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
            model_type=model_type,
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
            raw=raw,
        )
