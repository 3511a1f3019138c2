"""A new DFLASH draft for a target: its z-lab ``config.json``, its initial weights, and how it is
written (``config.json`` + ``model.safetensors``, loadable by ``load_draft`` and by z-lab's
``dflash.model.DFlashDraftModel.from_pretrained``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.config import ModelConfig
from common.model.dflash import DFlashDraftModel
from common.model.dflash_config import DRAFT_ARCHITECTURE, build_target_layer_ids
from common.tokenizer import Tokenizer
from common.training.draft_config import DraftArch

MASK_TOKEN_NAMES = ("<|mask|>", "<|MASK|>", "<mask>")


def resolve_mask_token_id(requested: int | None, tokenizer: Tokenizer | None,
                          target: ModelConfig) -> int:
    """The mask token id for ``requested`` (None: see :class:`DraftArch`)."""
    if requested is not None:
        if not 0 <= requested < target.vocab_size:
            raise ValueError(f"mask token id {requested} is outside the target vocabulary "
                             f"0..{target.vocab_size - 1}")
        return requested
    if tokenizer is not None:
        for name in MASK_TOKEN_NAMES:
            ids = tokenizer.encode(name, add_special_tokens=False)
            if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "":
                return ids[0]  # a special token: the text name became one id
        if tokenizer.vocab_size < target.vocab_size:
            return tokenizer.vocab_size
    raise ValueError("cannot choose a mask token: the tokenizer has none and the model has no "
                     "spare vocabulary row; give --mask-token-id")


def draft_config_dict(target: ModelConfig, arch: DraftArch, *, mask_token_id: int,
                      dtype: str) -> dict:
    """The z-lab ``config.json`` of a draft of ``arch`` for ``target``."""
    n = target.num_hidden_layers
    if arch.target_layer_ids is not None:
        ids = list(arch.target_layer_ids)
    else:
        # z-lab's rule repeats layers of a shallow target (4 layers, 2 draft layers: [1, 1])
        ids = sorted(set(build_target_layer_ids(n, arch.num_layers)))
    heads = arch.num_heads or target.num_attention_heads
    kv_heads = arch.num_kv_heads or min(heads, target.num_key_value_heads)
    intermediate = arch.intermediate_size or target.intermediate_size or 3 * target.hidden_size
    return {
        "architectures": [DRAFT_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": arch.rope_theta or target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "vocab_size": target.vocab_size,
        "num_target_layers": n,
        "block_size": arch.block_size,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask_token_id,
                          "block_size": arch.block_size},
        "dtype": dtype,
    }


@torch.no_grad()
def init_draft_weights(draft: DFlashDraftModel, seed: int, std: float = 0.02) -> None:
    """transformers' initialisation of Qwen3 layers: N(0, std) matrices, zero biases, unit
    norms (the draft's norms are plain ``x̂ · w``). Drawn on the CPU, so any device gets the
    same draft from the same seed."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(draft.named_parameters()):
        if name.endswith("norm.weight"):
            value = torch.ones(p.shape)
        elif name.endswith(".bias"):
            value = torch.zeros(p.shape)
        else:
            value = torch.randn(p.shape, generator=gen) * std
        p.copy_(value.to(p.dtype))


def save_draft(draft: DFlashDraftModel, config: dict, out_dir: str | Path, *,
               dtype: str) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (weights in ``dtype``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cast = getattr(torch, dtype)
    tensors = {name: p.detach().to("cpu", cast).contiguous()
               for name, p in draft.named_parameters()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n")
    return out
