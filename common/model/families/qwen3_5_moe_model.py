"""Qwen3.5-MoE's model code (its declaration is ``qwen3_5_moe.py``): the wrapper class, and the
per-expert checkpoint tensors sliced into the packed experts."""

from __future__ import annotations

from common.model.families.qwen3_5_moe import MODEL_TYPE
from common.model.qwen3_5 import HybridForCausalLM
from common.model.weight_rules import per_expert_slices


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    """Qwen3.5-MoE text model: every layer's MLP is routed experts plus a shared expert."""

    model_types = (MODEL_TYPE,)


WRAPPER = Qwen3_5MoeForCausalLM
WEIGHT_RULES = (per_expert_slices,)
