"""Model geometries for benchmarks with random weights: released models (from their config.json
files) and the larger trained pair of docs/training.md."""

from __future__ import annotations

import json
from pathlib import Path

from common.config import ModelConfig
from common.model.family_registry import parse_model_config

_QWEN3_5_COMMON = {
    "head_dim": 256, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
    "vocab_size": 248320, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
}

QWEN3_5_4B = {
    **_QWEN3_5_COMMON, "model_type": "qwen3_5_text", "hidden_size": 2560,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "linear_num_value_heads": 32, "intermediate_size": 9216, "tie_word_embeddings": True,
}

QWEN3_5_35B_A3B = {
    **_QWEN3_5_COMMON, "model_type": "qwen3_5_moe_text", "hidden_size": 2048,
    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
    "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
}

# The two larger Qwen3.5-MoE releases. 397B-A17B: as its model card lists it (hidden 4096, 60
# layers, 512 experts of 1024, 10 routed + 1 shared, attention 32 Q / 2 KV of 256, GDN 16 QK /
# 64 V heads of 128). 122B-A10B: hidden 3072, 48 layers, 256 experts of 1024 (8 routed + 1
# shared), attention 32 Q / 2 KV, GDN 16 QK / 64 V heads; its head counts are recalled from its
# config.json, not re-read here (the total they give, 122.1B with vision and MTP left out, agrees
# with the release's name).
QWEN3_5_122B_A10B = {
    **_QWEN3_5_COMMON, "model_type": "qwen3_5_moe_text", "hidden_size": 3072,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 2,
    "linear_num_value_heads": 64, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
    "tie_word_embeddings": False,
}

QWEN3_5_397B_A17B = {
    **_QWEN3_5_COMMON, "model_type": "qwen3_5_moe_text", "hidden_size": 4096,
    "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 2,
    "linear_num_value_heads": 64, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
    "tie_word_embeddings": False,
}

# The larger trained pair of docs/training.md (about 280M parameters: the shape training reads
# from large_target_arch.json, with the built-in tokenizer's vocabulary), so that its steps can
# be timed with random weights, without training it first.
PYCODER_LARGE = {
    **json.loads((Path(__file__).parent / "large_target_arch.json").read_text()),
    "model_type": "qwen3_5_text", "vocab_size": 8192, "dtype": "bfloat16",
}

SHAPES = {"qwen3.5-4b": QWEN3_5_4B, "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
          "qwen3.5-122b-a10b": QWEN3_5_122B_A10B, "qwen3.5-397b-a17b": QWEN3_5_397B_A17B,
          "pycoder-large": PYCODER_LARGE}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    return parse_model_config(dict(SHAPES[name]))


# A z-lab-style DFLASH draft for the 4B target (geometry of z-lab's Qwen3-4B-DFlash-b16 draft;
# target layer ids by the default rule for 32 target layers and 5 draft layers).
QWEN3_5_4B_DRAFT = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "hidden_act": "silu", "vocab_size": 248320,
    "num_target_layers": 32, "block_size": 16,
    "dflash_config": {"mask_token_id": 248070},
}

# The larger pair's draft as train-draft makes it by default: 2 layers of the target's width,
# its attention heads, target layers 1 and 17 by z-lab's rule for 20 target layers.
PYCODER_LARGE_DRAFT = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "attention_bias": False, "hidden_act": "silu", "vocab_size": 8192,
    "num_target_layers": 20, "block_size": 16,
    "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 17]},
}

# the shapes that have a draft for DFLASH benchmarks with random weights
DRAFTS = {"qwen3.5-4b": QWEN3_5_4B_DRAFT, "pycoder-large": PYCODER_LARGE_DRAFT}
