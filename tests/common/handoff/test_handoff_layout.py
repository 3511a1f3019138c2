"""LayoutDescriptor.from_model, the shapes it fixes, check_compatible and model_fingerprint."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.handoff.errors import HandoffError
from common.handoff.layout import LayoutDescriptor, model_fingerprint
from common.model.family_registry import parse_model_config


def test_from_model(config, layout):
    assert layout.full_attention_layers == (1, 3) and layout.gdn_layers == (0, 2)
    assert layout.dtype == "bfloat16" and layout.ssm_dtype == "float32"
    assert layout.conv_dim == 2 * 2 * 8 + 4 * 6 and layout.conv_window == 3
    assert layout.field_shape("kv", 33) == (2, 2, 3, 16, 2, 16)  # 33 tokens -> 3 pages of 16
    assert layout.field_shape("conv_state", 33) == (2, 56, 3)
    assert layout.field_shape("ssm_state", 33) == (2, 4, 6, 8)  # hv_v_k: [HV, V, K]
    k_major = LayoutDescriptor.from_model(config, 16, "bfloat16", state_layout="hv_k_v")
    assert k_major.field_shape("ssm_state", 1) == (2, 4, 8, 6)
    assert layout.field_shape("top_k", 1) is None
    assert LayoutDescriptor.from_model(config, 16, "torch.bfloat16") == layout


def test_from_model_rejects_bad_settings(config):
    with pytest.raises(ValueError):
        LayoutDescriptor.from_model(config, 0, torch.bfloat16)
    with pytest.raises(ValueError):
        LayoutDescriptor.from_model(config, 16, torch.bfloat16, state_layout="k_v")
    with pytest.raises(ValueError):
        LayoutDescriptor.from_model(config, 16, "bfloat17")


def test_check_compatible_names_every_difference(layout):
    layout.check_compatible(dataclasses.replace(layout))
    theirs = dataclasses.replace(layout, ssm_dtype="bfloat16", gdn_layers=(0,))
    with pytest.raises(HandoffError) as info:
        layout.check_compatible(theirs)
    assert info.value.code == "FAILED_PRECONDITION"
    assert "ssm_dtype" in info.value.message and "gdn_layers" in info.value.message


def test_fingerprint(config, tiny_dict):
    fp = model_fingerprint(config, "random:0")
    assert len(fp) == 64 and fp == model_fingerprint(parse_model_config(tiny_dict), "random:0")
    assert fp != model_fingerprint(config, "random:1")
    assert fp != model_fingerprint(parse_model_config({**tiny_dict, "rms_norm_eps": 1e-5}),
                                   "random:0")
    # keys the architecture does not read leave it unchanged
    assert fp == model_fingerprint(parse_model_config({**tiny_dict, "comment": "x"}), "random:0")
