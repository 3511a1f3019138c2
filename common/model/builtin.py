"""The built-in model ``tiny``: a small Qwen3.5-architecture model that needs no download.

Its weights are drawn from a fixed seed, so every machine builds the same model bit for bit; it
pairs with the byte-level tokenizer (vocabulary 260 = 256 bytes + 4 special tokens). ``tiny``
also names a built-in DFLASH draft for it (``TINY_DRAFT_CONFIG``, ``common.model.dflash``); its
random weights make it propose poorly, which exercises rejection as much as acceptance.
"""

from __future__ import annotations

import math

from common.config import ModelConfig
from common.model.family_registry import parse_model_config

TINY_NAME = "tiny"
TINY_SEED = 20261129
TINY_EOS = 256

TINY_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 260,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                    "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "eos_token_id": TINY_EOS,
    "dtype": "float32",
}


def tiny_config() -> ModelConfig:
    return parse_model_config(dict(TINY_CONFIG))


def fill_deterministic(named_params, seed: int = TINY_SEED, *, device: str = "cpu") -> None:
    """Fill parameters from a seeded generator, in name order.

    ``device`` is where the numbers are drawn: the default CPU gives the same weights on every
    machine (the built-in model); "cuda" draws billions of them quickly (benchmark models).
    """
    import torch  # here, not at the top: the router reads tiny's config without torch

    with torch.no_grad():
        gen = torch.Generator(device=device).manual_seed(seed)
        on = dict(generator=gen, device=device)
        for name, p in sorted(named_params, key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                value = torch.empty(p.shape, device=device).uniform_(1.0, 16.0,
                                                                     generator=gen).log()
            elif leaf == "dt_bias":
                value = torch.randn(p.shape, **on) * 0.5
            elif name.endswith("norm.weight"):
                value = torch.randn(p.shape, **on) * 0.1
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                value = torch.randn(p.shape, **on) / math.sqrt(fan_in)
            p.copy_(value.to(p.dtype))


TINY_DRAFT_SEED = 20261130

# z-lab draft config.json format; target_layer_ids pick 2 of tiny's 4 layers, mask id is the byte
# tokenizer's <|mask|>.
TINY_DRAFT_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "hidden_act": "silu",
    "num_target_layers": 4,
    "block_size": 8,
    "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 257},
    "dtype": "float32",
}


def fill_draft_deterministic(named_params, seed: int = TINY_DRAFT_SEED, *,
                             device: str = "cpu") -> None:
    """Fill draft parameters from a seeded generator, in name order.

    The draft's norms are plain ``x̂ · w``, so their weights are drawn around 1, not 0.
    """
    import torch  # here, not at the top: the router reads tiny's config without torch

    with torch.no_grad():
        gen = torch.Generator(device=device).manual_seed(seed)
        on = dict(generator=gen, device=device)
        for name, p in sorted(named_params, key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                value = 1.0 + torch.randn(p.shape, **on) * 0.1
            elif name.endswith(".bias"):
                value = torch.randn(p.shape, **on) * 0.02
            else:
                value = torch.randn(p.shape, **on) / math.sqrt(p.shape[-1])
            p.copy_(value.to(p.dtype))
