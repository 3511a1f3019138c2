"""Tiny random transformers checkpoints for tests (the oracle side of model and loader tests).

``make_checkpoint(kind, path)`` builds a tiny transformers model of one of the supported families,
gives it random non-degenerate weights and ``save_pretrained``s it; ``load_hf_model(kind, path)``
reads it back with transformers. Everything runs on CPU in fp32 within a few seconds.

transformers 5.24 writes the Hub layout: per-expert MoE tensors
(``mlp.experts.{e}.gate_proj.weight`` etc.) for both MoE families, Qwen3-Next's interleaved
``in_proj_qkvz`` / ``in_proj_ba``, Qwen3.5's split projections, and the
``model.language_model.`` / ``model.visual.`` prefixes for the ``qwen3_5`` wrapper.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# transformers routes the GDN layers to fla's Triton kernels whenever fla imports, and those crash
# on CPU: tests/conftest.py imports its modeling modules with fla hidden, before any test does

KINDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5")

TINY_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.25,  # rotary dim 4
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    intermediate_size=96,
)
TINY_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
TINY_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
    patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
)


def _classes(kind: str):
    """(config class, model class) of a kind; imported lazily so importing this file is cheap."""
    import transformers as tf

    table = {
        "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
        "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    }
    if kind not in table:
        raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {KINDS}")
    config_name, model_name = table[kind]
    return getattr(tf, config_name), getattr(tf, model_name)


def make_config(kind: str, *, tie: bool = False, **overrides):
    """The tiny transformers config of ``kind``; ``overrides`` replace text-config fields.

    For ``qwen3_next`` the default leaves ``layer_types`` out so the pattern comes from
    ``full_attention_interval`` (4), as in the released Qwen3-Next configs; pass ``layer_types``
    to set it explicitly.
    """
    config_cls, _ = _classes(kind)
    text = dict(TINY_TEXT)
    if kind in ("qwen3_5_moe_text", "qwen3_next"):
        text.update(TINY_MOE)
    if kind == "qwen3_next" and "layer_types" not in overrides:
        text.pop("layer_types")
        text["full_attention_interval"] = 4
    text.update(overrides)
    text["tie_word_embeddings"] = tie
    if kind == "qwen3_5":
        # small Qwen3.5 releases carry tie_word_embeddings both at the top level and in text_config
        return config_cls(text_config=text, vision_config=dict(TINY_VISION),
                          tie_word_embeddings=tie)
    return config_cls(**text)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter random values that exercise the model's conventions.

    Norm weights are random (not 0 / 1) so a model that mixes up the zero-centred ``x·(1+w)`` norms
    with the plain-weight GDN ``linear_attn.norm`` gives different logits; A_log and dt_bias are
    random so the decay gate is not the same for every head.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=gen) * std + mean)

    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))  # log U(1, 16)
        elif name.endswith("dt_bias"):
            normal(p, 1.0)
        elif name.endswith("linear_attn.norm.weight") or ("visual" in name and p.dim() == 1
                                                         and name.endswith("weight")):
            normal(p, 0.1, mean=1.0)  # plain-weight norms (GDN gated norm, vision LayerNorms)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            normal(p, 0.1)  # zero-centred RMSNorm: applied as (1 + w)
        else:
            normal(p, 0.02)


def make_checkpoint(kind: str, path, *, seed: int = 0, tie: bool = False,
                    max_shard_size=None, **overrides) -> Path:
    """Build a tiny random ``kind`` model and ``save_pretrained`` it (fp32) to ``path``.

    kind: ``qwen3_5_text`` (Qwen3_5ForCausalLM), ``qwen3_5_moe_text`` (Qwen3_5MoeForCausalLM),
    ``qwen3_next`` (Qwen3NextForCausalLM) or ``qwen3_5`` (Qwen3_5ForConditionalGeneration with a
    tiny vision tower). ``max_shard_size`` (e.g. ``"20KB"``) makes a sharded checkpoint with an
    index. Returns the directory.
    """
    config = make_config(kind, tie=tie, **overrides)
    _, model_cls = _classes(kind)
    model = model_cls(config).to(torch.float32)
    randomize_(model, seed)
    if tie:
        model.tie_weights()
    path = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if kind == "qwen3_next" and "layer_types" not in overrides:
        # transformers writes the derived layer_types back; released configs only carry the interval
        file = path / "config.json"
        cfg = json.loads(file.read_text())
        cfg.pop("layer_types", None)
        cfg["full_attention_interval"] = overrides.get("full_attention_interval", 4)
        file.write_text(json.dumps(cfg, indent=2))
    return path


def load_hf_model(kind: str, path) -> torch.nn.Module:
    """The transformers model saved at ``path``, fp32, eval mode.

    For ``qwen3_5`` this is the ForConditionalGeneration wrapper; its text body is
    ``model.model.language_model`` and its head ``model.lm_head``.
    """
    _, model_cls = _classes(kind)
    model = model_cls.from_pretrained(Path(path), dtype=torch.float32)
    return model.eval()

