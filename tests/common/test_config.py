"""ModelConfig as parse_model_config builds it: each model type, transformers' defaults,
wrappers, and refusals."""

import json

import pytest

from common.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError
from common.model.family_registry import parse_model_config, read_model_config


def small(model_type, **over):
    cfg = dict(model_type=model_type, vocab_size=64, hidden_size=32, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, intermediate_size=48)
    cfg.update(over)
    return cfg


def test_qwen3_5_text_defaults_fill_what_the_file_omits():
    c = parse_model_config({"model_type": "qwen3_5_text"})
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (248320, 4096, 32)
    assert c.rope_theta == 10000000.0 and c.partial_rotary_factor == 0.25
    assert c.num_experts == 0 and not c.is_moe_layer(0)
    assert c.dtype == "float32" and c.eos_token_ids == () and not c.is_wrapper


def test_qwen3_5_text_is_dense_even_when_the_file_names_experts():
    c = parse_model_config(small("qwen3_5_text", num_experts=8))
    assert c.num_experts == 0


def test_qwen3_next_defaults_and_sparse_step():
    c = parse_model_config({"model_type": "qwen3_next"})
    assert (c.num_experts, c.num_experts_per_tok, c.rope_theta) == (512, 10, 10000.0)
    c = parse_model_config(small("qwen3_next", num_experts=4, num_experts_per_tok=2,
                                    decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


def test_qwen3_5_moe_text_every_layer_is_moe():
    c = parse_model_config(small("qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                                    decoder_sparse_step=2, mlp_only_layers=[1]))
    assert all(c.is_moe_layer(i) for i in range(4))
    assert c.norm_topk_prob  # the field is gone from the family: always renormalised


def test_layer_types_default_to_every_fourth_full_attention():
    c = parse_model_config(small("qwen3_5_text", num_hidden_layers=8))
    assert c.full_attention_layers == (3, 7)
    assert c.linear_attention_layers == (0, 1, 2, 4, 5, 6)
    c = parse_model_config(small("qwen3_5_text", full_attention_interval=2))
    assert c.full_attention_layers == (1, 3)


def test_explicit_layer_types_win():
    types = [FULL_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION]
    c = parse_model_config(small("qwen3_5_text", layer_types=types))
    assert c.layer_types == tuple(types)


@pytest.mark.parametrize("wrapper,text_type", [("qwen3_5", "qwen3_5_text"),
                                               ("qwen3_5_moe", "qwen3_5_moe_text")])
def test_wrapper_reads_text_config_and_top_level_fallbacks(wrapper, text_type):
    text = small(text_type)
    del text["model_type"]
    c = parse_model_config({"model_type": wrapper, "text_config": text,
                               "tie_word_embeddings": True, "eos_token_id": [5, 6],
                               "torch_dtype": "torch.bfloat16"})
    assert c.model_type == text_type and c.is_wrapper
    assert c.tie_word_embeddings and c.eos_token_ids == (5, 6) and c.dtype == "bfloat16"
    assert c.hidden_size == 32


def test_wrapper_text_config_values_win_over_top_level():
    c = parse_model_config({"model_type": "qwen3_5",
                               "text_config": small("qwen3_5_text", eos_token_id=9),
                               "eos_token_id": 1})
    assert c.eos_token_ids == (9,)


def test_rope_parameters_override_flat_fields_and_nulls_fall_back_to_defaults():
    c = parse_model_config(small("qwen3_5_text", rope_theta=1.0, head_dim=None,
                                    rope_parameters={"rope_theta": 500.0,
                                                     "partial_rotary_factor": 0.5,
                                                     "rope_type": "default"}))
    assert c.rope_theta == 500.0 and c.partial_rotary_factor == 0.5
    assert c.head_dim == 256 and c.rotary_dim == 128


def test_derived_sizes():
    c = parse_model_config(small("qwen3_5_text"))
    assert (c.key_dim, c.value_dim, c.conv_dim) == (16, 32, 64)


@pytest.mark.parametrize("cfg,match", [
    ({"model_type": "llama"}, "not supported"),
    ({}, "not supported"),
    ({"model_type": "qwen3_5", "text_config": {"model_type": "llama"}}, "expected .qwen3_5_text."),
    (small("qwen3_5_text", rope_scaling={"rope_type": "yarn"}), "rope_type 'yarn'"),
    (small("qwen3_5_text", layer_types=[LINEAR_ATTENTION] * 3), "layer_types has 3"),
    (small("qwen3_5_text", layer_types=["sliding"] * 4), "unknown layer types"),
    (small("qwen3_5_text", linear_num_value_heads=3), "multiple of linear_num_key_heads"),
    (small("qwen3_5_text", num_key_value_heads=3), "multiple of num_key_value_heads"),
    (small("qwen3_5_text", partial_rotary_factor=2.0), "rotary dim"),
])
def test_refusals(cfg, match):
    with pytest.raises(ConfigError, match=match):
        parse_model_config(cfg)


def test_read_model_config_reads_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(small("qwen3_next")))
    assert read_model_config(tmp_path).model_type == "qwen3_next"
