"""Build a model by name or path: the built-in ``tiny``, a built-in trained checkpoint by name
(``common/model/registry.py``), or a safetensors checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import ModelConfig
from common.model.builtin import TINY_NAME, fill_deterministic
from common.model.family_registry import model_class_for
from common.model.kernels import Kernels
from common.model.loader import full_parameter_shapes, load_weights
from common.model.qwen3_5 import HybridForCausalLM
from common.model.registry import load_config, resolve_model
from common.parallel.group import TensorParallelGroup


def load_model(name_or_path: str, *, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu", kernels: Kernels | None = None,
               progress: bool = False, tp: TensorParallelGroup | None = None,
               expert_parallel: bool = False) -> HybridForCausalLM:
    """Build the model on ``device`` and fill its weights (streamed, one tensor at a time).

    ``tp``: this rank's tensor-parallel group; the model then holds and reads only its shard
    (ShardingError, before anything is read, when the group's size does not fit the model);
    ``expert_parallel``: whole routed experts per rank (``ShardPlan``)."""
    name_or_path = resolve_model(name_or_path)
    config = load_config(name_or_path)
    if name_or_path != TINY_NAME and not Path(name_or_path).is_dir():
        raise FileNotFoundError(f"model {name_or_path!r} is neither 'tiny' nor a directory")
    with torch.device(device):
        model = model_class_for(config)(config, dtype=dtype, kernels=kernels, tp=tp,
                                        expert_parallel=expert_parallel)
    params = dict(model.named_parameters())
    plan = model.shard_plan
    if name_or_path != TINY_NAME:
        load_weights(params, name_or_path, config, plan=plan, progress=progress)
    elif not plan.is_sharded:
        fill_deterministic(params.items())
    else:
        # the built-in weights are drawn in name order over full shapes; draw them all (the
        # model is a few MB) and keep this rank's part, so every group size has the same model
        full = {name: torch.empty(shape) for name, shape in full_parameter_shapes(config).items()}
        fill_deterministic(full.items())
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(plan.take(name, full[name]))
    return model.eval()


def full_vocabulary(name_or_path: str, config: ModelConfig, *, dtype: torch.dtype,
                    device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole input embedding and output weight ``([V, H], [V, H])`` of a model, the same
    tensor twice when they are tied: what a DFLASH draft reads on rank 0 of a sharded target,
    which holds only its vocabulary rows of them."""
    from common.model.loader import EMBED, LM_HEAD, read_whole

    name_or_path = resolve_model(name_or_path)
    names = (EMBED,) if config.tie_word_embeddings else (EMBED, LM_HEAD)
    if name_or_path == TINY_NAME:
        full = {name: torch.empty(shape) for name, shape in full_parameter_shapes(config).items()}
        fill_deterministic(full.items())
    else:
        full = read_whole(name_or_path, config, names)
    embed, head = (full[names[0]], full[names[-1]])
    embed = embed.to(device=device, dtype=dtype)
    return embed, embed if head is full[names[0]] else head.to(device=device, dtype=dtype)


def weights_identity(name_or_path: str) -> str:
    """Names the weights for the handoff fingerprint: the built-in seed, or the checkpoint's
    safetensors files with their sizes (cheap, and changes when any file is replaced)."""
    if name_or_path == TINY_NAME:
        from common.model.builtin import TINY_SEED
        return f"builtin:{TINY_NAME}:{TINY_SEED}"
    files = sorted(Path(resolve_model(name_or_path)).glob("*.safetensors"))
    return ";".join(f"{f.name}:{f.stat().st_size}" for f in files)


def eos_token_ids_for(name_or_path: str, config: ModelConfig) -> tuple[int, ...]:
    """End-of-sequence ids: the tokenizer's (tokenizer_config / generation_config) when the
    checkpoint has one, else the model config's."""
    from common.tokenizer import load_tokenizer

    try:
        ids = tuple(load_tokenizer(name_or_path).eos_token_ids)
    except (ValueError, FileNotFoundError):
        ids = ()
    return ids or config.eos_token_ids
