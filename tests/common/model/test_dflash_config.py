"""DFLASH draft config parsing / target checks, and the draft weight loader's errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from common.model.builtin import TINY_DRAFT_CONFIG, tiny_config
from common.model.dflash import DFlashDraftModel, load_draft
from common.model.dflash_config import DFlashConfig, DraftConfigError, build_target_layer_ids
from common.model.load import load_model
from common.model.loader import WeightLoadError

TARGET = tiny_config()  # 4 layers, hidden 128, vocab 260


def cfg(**changes):
    out = json.loads(json.dumps(TINY_DRAFT_CONFIG))
    nested = changes.pop("dflash_config", None)
    if nested is not None:
        out["dflash_config"].update(nested)
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def parse(**changes):
    return DFlashConfig.from_dict(cfg(**changes), target=TARGET)


def test_tiny_draft_config():
    c = parse()
    assert (c.num_hidden_layers, c.hidden_size, c.head_dim, c.block_size) == (2, 128, 32, 8)
    assert c.target_layer_ids == (1, 2) and c.mask_token_id == 257
    assert c.layer_types == ("full_attention",) * 2
    assert not c.layer_is_causal(0) and c.layer_window(0) is None


def test_default_layer_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 1) == [18]
    # no ids in the config: the rule over num_target_layers (else the target's layer count)
    c = parse(dflash_config={"target_layer_ids": None}, num_target_layers=None,
              num_hidden_layers=1)
    assert c.target_layer_ids == (2,)
    c = parse(dflash_config={"target_layer_ids": None})
    assert c.target_layer_ids == tuple(build_target_layer_ids(4, 2))


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=64), "hidden_size 64 differs from the target's hidden_size 128"),
    (dict(dflash_config={"mask_token_id": 260}), "mask_token_id 260 is outside the target "
                                                 "vocabulary"),
    (dict(dflash_config={"mask_token_id": -1}), "mask_token_id -1 is outside"),
    (dict(dflash_config={"mask_token_id": None}), "no dflash_config.mask_token_id"),
    (dict(dflash_config={"target_layer_ids": [1, 4]}), r"target_layer_ids \[4\] are outside "
                                                       r"the target's layers 0..3"),
    (dict(architectures=["DFlash2DraftModel"]), "not a DFLASH draft"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "need a positive sliding_window"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(num_key_value_heads=3), "not a multiple"),
])
def test_config_errors(changes, message):
    with pytest.raises(DraftConfigError, match=message):
        parse(**changes)


def test_config_fields():
    c = parse(block_size=16, dflash_config={"block_size": 4})  # nested wins
    assert c.block_size == 4
    c = parse(layer_types=["sliding_attention", "full_attention"], sliding_window=64,
              use_sliding_window=False, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e6})
    # the trained window is kept even where transformers' Qwen3Config would drop it
    assert c.layer_window(0) == 64 and c.layer_window(1) is None
    assert c.layer_is_causal(0) and not c.layer_is_causal(1)
    assert c.rope_theta == 1e6
    c = parse(layer_types=["sliding_attention", "full_attention"], sliding_window=64,
              is_causal=False)
    assert not c.layer_is_causal(0) and not c.layer_is_causal(1)
    c = parse(is_causal=True)
    assert c.layer_is_causal(1)


@pytest.fixture(scope="module")
def target():
    return load_model("tiny")


def save_draft(path, target, *, drop=(), extra=None, replace=None, config=None):
    """Write the tiny draft's weights as a z-lab checkpoint, edited as asked."""
    draft = load_draft("tiny", target)
    tensors = {n: p.detach().clone() for n, p in draft.named_parameters() if n not in drop}
    tensors.update(extra or {})
    tensors.update(replace or {})
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config or TINY_DRAFT_CONFIG))
    return draft


def test_checkpoint_round_trip(tmp_path, target):
    draft = save_draft(tmp_path, target)
    loaded = load_draft(str(tmp_path), target)
    for (n, a), (_, b) in zip(draft.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), n
    # the draft borrows nothing by copy: it has no embedding or head of its own
    assert not any("embed" in n or "lm_head" in n for n, _ in loaded.named_parameters())
    assert isinstance(loaded, DFlashDraftModel)


def test_weight_errors_name_the_tensor(tmp_path, target):
    save_draft(tmp_path / "missing", target, drop=("layers.1.self_attn.k_norm.weight",))
    with pytest.raises(WeightLoadError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        load_draft(str(tmp_path / "missing"), target)

    save_draft(tmp_path / "extra", target, extra={"layers.0.mlp.conv.weight": torch.zeros(3)})
    with pytest.raises(WeightLoadError, match=r"unexpected checkpoint tensor "
                                              r"'layers\.0\.mlp\.conv\.weight'"):
        load_draft(str(tmp_path / "extra"), target)

    save_draft(tmp_path / "shape", target,
               replace={"layers.0.self_attn.q_proj.weight": torch.zeros(100, 128)})
    with pytest.raises(WeightLoadError, match=r"'layers\.0\.self_attn\.q_proj\.weight' has "
                                              r"shape \[100, 128\], expected \[128, 128\]"):
        load_draft(str(tmp_path / "shape"), target)

    save_draft(tmp_path / "fc", target, replace={"fc.weight": torch.zeros(128, 384)})
    with pytest.raises(WeightLoadError, match=r"width 384 is not K\*H = 2\*128 = 256"):
        load_draft(str(tmp_path / "fc"), target)

    bias_cfg = cfg(attention_bias=True)
    save_draft(tmp_path / "bias", target, config=bias_cfg)
    with pytest.raises(WeightLoadError, match=r"layers\.0\.self_attn\.q_proj\.bias"):
        load_draft(str(tmp_path / "bias"), target)


def test_tiny_draft_is_deterministic(target):
    a, b = load_draft("tiny", target), load_draft("tiny", target)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(FileNotFoundError):
        load_draft("no/such/dir", target)
