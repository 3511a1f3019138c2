"""Model families by model_type: lookup, the error for an unknown type, each family's parse, and
the model code kept apart from it."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from common.model.family_registry import (families, family_for, known_model_types,
                                          model_class_for, parse_model_config)

TEXT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=48,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16)


def test_unknown_model_type_names_the_known_ones():
    with pytest.raises(ConfigError) as err:
        parse_model_config({"model_type": "llama"})
    message = str(err.value)
    assert "'llama'" in message
    for model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                       "qwen3_next"):
        assert repr(model_type) in message


def test_missing_model_type_is_a_config_error():
    with pytest.raises(ConfigError, match="None"):
        parse_model_config({"hidden_size": 32})


def test_every_model_type_belongs_to_exactly_one_family():
    types = [t for family in families() for t in family.model_types]
    assert len(types) == len(set(types)) == len(known_model_types())
    for family in families():
        for model_type in family.model_types:
            assert family_for(model_type) is family


@pytest.mark.parametrize("family", families(), ids=lambda f: f.text_model_type)
def test_each_family_parses_its_text_config(family):
    config = parse_model_config({"model_type": family.text_model_type, **TEXT})
    assert config.model_type == family.text_model_type and not config.is_wrapper
    assert config.hidden_size == 32 and config.num_hidden_layers == 4
    assert model_class_for(config) is family.wrapper
    for key, value in family.fixed.items():
        assert getattr(config, key) == value
    # a field the file omits takes the family's default
    assert config.rms_norm_eps == family.defaults["rms_norm_eps"]


@pytest.mark.parametrize("family", [f for f in families() if f.wrapper_model_type],
                         ids=lambda f: f.wrapper_model_type)
def test_each_wrapper_type_parses_its_text_config(family):
    config = parse_model_config({"model_type": family.wrapper_model_type, "text_config": TEXT,
                                 "tie_word_embeddings": True, "eos_token_id": 7})
    assert config.model_type == family.text_model_type and config.is_wrapper
    assert config.tie_word_embeddings and config.eos_token_ids == (7,)


def test_a_wrapper_holding_another_familys_text_config_is_an_error():
    with pytest.raises(ConfigError, match="qwen3_next"):
        parse_model_config({"model_type": "qwen3_5",
                            "text_config": {**TEXT, "model_type": "qwen3_next"}})


def test_family_choices_decide_the_layers():
    dense = parse_model_config({"model_type": "qwen3_5_text", **TEXT})
    assert dense.num_experts == 0 and not any(dense.is_moe_layer(i) for i in range(4))
    moe = parse_model_config({"model_type": "qwen3_5_moe_text", **TEXT, "norm_topk_prob": False,
                              "decoder_sparse_step": 2, "mlp_only_layers": [0]})
    assert moe.norm_topk_prob and all(moe.is_moe_layer(i) for i in range(4))
    nxt = parse_model_config({"model_type": "qwen3_next", **TEXT, "norm_topk_prob": False,
                              "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert not nxt.norm_topk_prob
    assert [nxt.is_moe_layer(i) for i in range(4)] == [False, False, False, True]


def test_checkpoint_names_follow_the_family():
    vision_language, qwen3_next = family_for("qwen3_5"), family_for("qwen3_next")
    assert vision_language.checkpoint_name("model.language_model.norm.weight") == "model.norm.weight"
    assert vision_language.checkpoint_name("model.visual.blocks.0.attn.qkv.weight") is None
    assert qwen3_next.checkpoint_name("mtp.fc.weight") is None
    assert qwen3_next.checkpoint_name("model.norm.weight") == "model.norm.weight"


def test_parsing_every_family_imports_no_model_code():
    """The router parses configs: families are plain data, their model code a module apart."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from common.model.family_registry import families\n"
            f"text = {TEXT!r}\n"
            "for f in families():\n"
            "    f.parse({**text, 'model_type': f.text_model_type})\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.endswith('_model'))\n"
            "print(loaded)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_model_module_whose_wrapper_serves_another_type_is_an_error():
    from common.model.families.family import ModelFamily

    family = ModelFamily(text_model_type="qwen3_next",
                         model_module="common.model.families.qwen3_5_model", defaults={})
    with pytest.raises(ValueError, match="qwen3_5_text"):
        family.wrapper
