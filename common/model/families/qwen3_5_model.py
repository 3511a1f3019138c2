"""Qwen3.5 dense's model code (its declaration is ``qwen3_5.py``): the wrapper class; no weight
rules of its own (every served tensor keeps its name)."""

from __future__ import annotations

from common.model.families.qwen3_5 import MODEL_TYPE
from common.model.qwen3_5 import HybridForCausalLM


class Qwen3_5ForCausalLM(HybridForCausalLM):
    """Qwen3.5 dense text model: every layer's MLP is a SwiGLU."""

    model_types = (MODEL_TYPE,)


WRAPPER = Qwen3_5ForCausalLM
WEIGHT_RULES = ()
