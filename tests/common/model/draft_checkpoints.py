"""Random z-lab-format DFLASH draft checkpoints for a given target (test helper)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.config import ModelConfig
from common.model.builtin import fill_draft_deterministic
from common.model.dflash import DFlashDraftModel
from common.model.dflash_config import DFlashConfig


def draft_config_dict(target: ModelConfig, *, block_size: int, mask_token_id: int,
                      target_layer_ids: list[int], num_layers: int = 2) -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": target.hidden_size, "intermediate_size": 2 * target.hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
        "hidden_act": "silu", "vocab_size": target.vocab_size,
        "num_target_layers": target.num_hidden_layers, "block_size": block_size,
        "dflash_config": {"target_layer_ids": target_layer_ids, "mask_token_id": mask_token_id},
    }


def make_draft_checkpoint(path, target: ModelConfig, *, block_size: int, mask_token_id: int,
                          target_layer_ids: list[int], seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of a random draft for ``target``."""
    cfg = draft_config_dict(target, block_size=block_size, mask_token_id=mask_token_id,
                            target_layer_ids=target_layer_ids)
    model = DFlashDraftModel(DFlashConfig.from_dict(cfg, target=target), dtype=torch.float32)
    with torch.no_grad():
        fill_draft_deterministic(model.named_parameters(), seed=seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"))
    return path
