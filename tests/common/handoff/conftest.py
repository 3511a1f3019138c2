"""A tiny hybrid config and random payloads for the handoff tests."""

from __future__ import annotations

import pytest
import torch

from common.config import ModelConfig
from common.handoff.layout import LayoutDescriptor, model_fingerprint
from common.handoff.payload import HandoffPayload, new_handoff_id
from common.model.family_registry import parse_model_config
from common.request_spec import RequestSpec
from common.sampling import SamplingParams

TINY = {
    "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4, "intermediate_size": 64,
    "full_attention_interval": 2,
}


@pytest.fixture
def tiny_dict() -> dict:
    return dict(TINY)


@pytest.fixture
def config() -> ModelConfig:
    return parse_model_config(TINY)


@pytest.fixture
def layout(config) -> LayoutDescriptor:
    return LayoutDescriptor.from_model(config, page_size=16, dtype=torch.bfloat16)


@pytest.fixture
def fingerprint(config) -> str:
    return model_fingerprint(config, "random:0")


@pytest.fixture
def make_payload(layout, fingerprint):
    """``make_payload(prompt_len, seed, **extra_fields)``: random payload, bitwise-reproducible."""

    def make(prompt_len: int = 37, seed: int = 0, **extra: torch.Tensor) -> HandoffPayload:
        gen = torch.Generator().manual_seed(seed)
        fields = {}
        for name in ("kv", "conv_state", "ssm_state"):
            shape = layout.field_shape(name, prompt_len)
            dtype = getattr(torch, layout.field_dtype(name))
            fields[name] = torch.randn(shape, generator=gen).to(dtype)
        fields.update(extra)
        prompt = tuple(torch.randint(0, 64, (prompt_len,), generator=gen).tolist())
        return HandoffPayload(handoff_id=new_handoff_id(), fingerprint=fingerprint, layout=layout,
                              spec=RequestSpec("req-1", prompt, SamplingParams(
                                  temperature=0.0, max_new_tokens=9)),
                              first_token=5, fields=fields)

    return make
