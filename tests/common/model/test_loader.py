"""common/model/loader.py against checkpoints that transformers writes (see checkpoints.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import LINEAR_ATTENTION, ModelConfig
from common.model.family_registry import model_class_for, read_model_config
from common.model.loader import WeightLoadError, load_weights
from tests.common.model.checkpoints import KINDS, load_hf_model, make_checkpoint

WRAPPER = "model.language_model."


# --- the parameters our model has (docs/architecture.md, "Parameter names") ---

def doc_params(c: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Parameters with the documented names and shapes, NaN-filled so that a gap shows."""
    H, V = c.hidden_size, c.vocab_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i, layer_type in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if layer_type == LINEAR_ATTENTION:
            hv, w = c.linear_num_value_heads, c.linear_conv_kernel_dim
            shapes.update({
                p + "linear_attn.in_proj_qkv.weight": (c.conv_dim, H),
                p + "linear_attn.in_proj_z.weight": (c.value_dim, H),
                p + "linear_attn.in_proj_b.weight": (hv, H),
                p + "linear_attn.in_proj_a.weight": (hv, H),
                p + "linear_attn.conv1d.weight": (c.conv_dim, 1, w),
                p + "linear_attn.A_log": (hv,),
                p + "linear_attn.dt_bias": (hv,),
                p + "linear_attn.norm.weight": (c.linear_value_head_dim,),
                p + "linear_attn.out_proj.weight": (H, c.value_dim),
            })
        else:
            heads, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            shapes.update({
                p + "self_attn.q_proj.weight": (heads * hd * 2, H),
                p + "self_attn.k_proj.weight": (kv * hd, H),
                p + "self_attn.v_proj.weight": (kv * hd, H),
                p + "self_attn.o_proj.weight": (H, heads * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
            })
        if c.is_moe_layer(i):
            e, im, ish = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            shapes.update({
                p + "mlp.gate.weight": (e, H),
                p + "mlp.experts.gate_up_proj": (e, 2 * im, H),
                p + "mlp.experts.down_proj": (e, H, im),
                p + "mlp.shared_expert.gate_proj.weight": (ish, H),
                p + "mlp.shared_expert.up_proj.weight": (ish, H),
                p + "mlp.shared_expert.down_proj.weight": (H, ish),
                p + "mlp.shared_expert_gate.weight": (1, H),
            })
        else:
            im = c.intermediate_size
            shapes.update({p + "mlp.gate_proj.weight": (im, H), p + "mlp.up_proj.weight": (im, H),
                           p + "mlp.down_proj.weight": (H, im)})
    return {name: torch.full(shape, float("nan"), dtype=dtype) for name, shape in shapes.items()}


# --- what transformers holds, in our names ---

def next_rows(c: ModelConfig) -> dict[str, list[int]]:
    """Rows of Qwen3-Next's in_proj_qkvz / in_proj_ba per part, written out from gdn.md §3.1."""
    hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // hk
    block = 2 * dk + 2 * r * dv
    heads = [(g, i) for g in range(hk) for i in range(r)]  # value head j = g*r + i
    return {
        "q": [g * block + d for g in range(hk) for d in range(dk)],
        "k": [g * block + dk + d for g in range(hk) for d in range(dk)],
        "v": [g * block + 2 * dk + i * dv + d for g, i in heads for d in range(dv)],
        "z": [g * block + 2 * dk + r * dv + i * dv + d for g, i in heads for d in range(dv)],
        "b": [g * 2 * r + i for g, i in heads],
        "a": [g * 2 * r + r + i for g, i in heads],
    }


def hf_expected(hf_model, c: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' tensors under our names (HF holds experts packed like we do)."""
    out = {}
    for name, t in hf_model.state_dict().items():
        if name.startswith("model.visual."):
            continue
        if name.startswith(WRAPPER):
            name = "model." + name[len(WRAPPER):]
        if name.endswith("in_proj_qkvz.weight"):
            rows, base = next_rows(c), name[: -len("in_proj_qkvz.weight")]
            out[base + "in_proj_qkv.weight"] = t[rows["q"] + rows["k"] + rows["v"]]
            out[base + "in_proj_z.weight"] = t[rows["z"]]
        elif name.endswith("in_proj_ba.weight"):
            rows, base = next_rows(c), name[: -len("in_proj_ba.weight")]
            out[base + "in_proj_b.weight"] = t[rows["b"]]
            out[base + "in_proj_a.weight"] = t[rows["a"]]
        else:
            out[name] = t
    if c.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def assert_params_equal(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert sorted(params) == sorted(expected)
    for name, p in params.items():
        assert torch.equal(p, expected[name].to(p.dtype)), name


# --- fixtures and checkpoint surgery ---

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """ckpt(kind, **kw) -> checkpoint dir, built once per distinct arguments."""
    made = {}

    def get(kind: str, **kw) -> Path:
        key = (kind, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_checkpoint(kind, tmp_path_factory.mktemp(kind), **kw)
        return made[key]

    return get


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint with ``edit(tensors)`` applied to its tensor dict."""
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def pack_experts(tensors: dict[str, torch.Tensor]) -> None:
    """Per-expert MoE tensors → the packed Hub form (Qwen3.5-MoE releases), in place."""
    bases = {n.split(".experts.")[0] for n in tensors if ".experts.0." in n}
    for base in bases:
        num = len({n for n in tensors
                   if n.startswith(base + ".experts.") and n.endswith("down_proj.weight")})
        pop = lambda e, proj: tensors.pop(f"{base}.experts.{e}.{proj}.weight")  # noqa: E731
        tensors[base + ".experts.gate_up_proj"] = torch.stack(
            [torch.cat([pop(e, "gate_proj"), pop(e, "up_proj")]) for e in range(num)])
        tensors[base + ".experts.down_proj"] = torch.stack(
            [pop(e, "down_proj") for e in range(num)])


def load(path: Path, params=None, **kw) -> dict[str, torch.Tensor]:
    config = read_model_config(path)
    params = doc_params(config) if params is None else params
    load_weights(params, path, config, **kw)
    return params


# --- loading what transformers writes ---

@pytest.mark.parametrize("kind", KINDS)
def test_loads_every_kind_with_transformers_values(ckpt, kind):
    path = ckpt(kind)
    config = read_model_config(path)
    params = load(path)
    assert_params_equal(params, hf_expected(load_hf_model(kind, path), config))


@pytest.mark.parametrize("kind,tie", [(kind, False) for kind in KINDS] + [("qwen3_5", True)])
def test_loads_into_our_model(ckpt, kind, tie):
    path = ckpt(kind, tie=tie)
    config = read_model_config(path)
    model = model_class_for(config)(config, dtype=torch.float32)
    params = dict(model.named_parameters())
    documented = doc_params(config)
    assert {n: tuple(p.shape) for n, p in params.items()} == \
        {n: tuple(p.shape) for n, p in documented.items()}
    for p in params.values():
        p.data.fill_(float("nan"))
    load(path, params)
    assert_params_equal(params, hf_expected(load_hf_model(kind, path), config))


def test_qwen3_next_deinterleave_matches_transformers(ckpt):
    path = ckpt("qwen3_next")
    config = read_model_config(path)
    hf = load_hf_model("qwen3_next", path)
    params = load(path)
    x = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    for i in config.linear_attention_layers:
        layer, p = hf.model.layers[i].linear_attn, f"model.layers.{i}.linear_attn."
        with torch.no_grad():
            q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x),
                                                                   layer.in_proj_ba(x))
        mixed_qkv = torch.cat([t.reshape(1, 5, -1) for t in (q, k, v)], dim=-1)
        ours = {part: x @ params[f"{p}in_proj_{part}.weight"].T for part in ("qkv", "z", "b", "a")}
        torch.testing.assert_close(ours["qkv"], mixed_qkv, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours["z"], z.reshape(1, 5, -1), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours["b"], b, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours["a"], a, atol=1e-6, rtol=1e-5)


def test_sharded_checkpoint(ckpt):
    path = ckpt("qwen3_next", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    assert_params_equal(load(path), load(ckpt("qwen3_next")))


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5"])
def test_tied_head(ckpt, tmp_path, kind):
    path = ckpt(kind, tie=True)
    config = read_model_config(path)
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    expected = hf_expected(load_hf_model(kind, path), config)
    # named_parameters() of a tied model lists the embedding only
    assert_params_equal(load(path), expected)
    # a dict that lists the shared tensor under both names: filled once
    params = doc_params(config)
    params["lm_head.weight"] = params["model.embed_tokens.weight"]
    load(path, params)
    assert torch.equal(params["lm_head.weight"], expected["model.embed_tokens.weight"])
    # a tied checkpoint that still stores a head: the head is ignored
    other = rewrite(path, tmp_path / "with_head", lambda t: t.__setitem__(
        "lm_head.weight", torch.zeros(config.vocab_size, config.hidden_size)))
    assert_params_equal(load(other), expected)


def test_packed_and_per_expert_moe_load_the_same(ckpt, tmp_path):
    per_expert = ckpt("qwen3_5_moe_text")
    names = load_file(per_expert / "model.safetensors")
    # transformers 5.24 reverses its expert fusion on save: the file is per-expert
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    packed = rewrite(per_expert, tmp_path / "packed", pack_experts)
    packed_tensors = load_file(packed / "model.safetensors")
    assert packed_tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    config = read_model_config(per_expert)
    expected = hf_expected(load_hf_model("qwen3_5_moe_text", per_expert), config)
    assert_params_equal(load(per_expert), expected)
    assert_params_equal(load(packed), expected)
    # transformers itself reads the packed form into the same values
    hf_packed = load_hf_model("qwen3_5_moe_text", packed)
    assert_params_equal(load(packed), hf_expected(hf_packed, config))


def test_visual_and_mtp_tensors_are_ignored(ckpt, tmp_path):
    path = ckpt("qwen3_5")
    assert any(n.startswith("model.visual.") for n in load_file(path / "model.safetensors"))

    def add_extras(t):
        for name in ("mtp.fc.weight", "mtp.layers.0.mlp.experts.0.up_proj.weight",
                     "model.mtp.norm.weight", "visual.blocks.0.attn.qkv.weight"):
            t[name] = torch.ones(3, 3)

    extra = rewrite(path, tmp_path / "extra", add_extras)
    assert_params_equal(load(extra), load(path))


def test_dtype_conversion_and_progress(ckpt, capsys, monkeypatch):
    path = ckpt("qwen3_5_moe_text")
    config = read_model_config(path)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar is for terminals only
    monkeypatch.delenv("FLASHSPLIT_NO_PROGRESS", raising=False)
    params = load(path, doc_params(config, torch.bfloat16), progress=True)
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    assert_params_equal(params, hf_expected(load_hf_model("qwen3_5_moe_text", path), config))
    assert "Loading weights" in capsys.readouterr().err


# --- corrupted checkpoints ---

ATTN_K = "model.layers.3.self_attn.k_proj.weight"


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, shape):
    return lambda t: t.__setitem__(name, torch.zeros(shape))


CORRUPTIONS = {
    # case: (kind, edit, the name the error must contain)
    "missing": ("qwen3_5_text", _drop("model.layers.1.linear_attn.A_log"),
                "model.layers.1.linear_attn.A_log"),
    "missing_head": ("qwen3_5_text", _drop("lm_head.weight"), "lm_head.weight"),
    "missing_wrapped": ("qwen3_5", _drop(WRAPPER + "layers.3.self_attn.q_norm.weight"),
                        "model.layers.3.self_attn.q_norm.weight"),
    "wrong_shape": ("qwen3_5_text", _set(ATTN_K, (16, 64)), ATTN_K),
    "wrong_shape_qkvz": ("qwen3_next", _set("model.layers.0.linear_attn.in_proj_qkvz.weight",
                                            (190, 64)),
                         "model.layers.0.linear_attn.in_proj_qkvz.weight"),
    "wrong_shape_expert": ("qwen3_next", _set("model.layers.2.mlp.experts.3.up_proj.weight",
                                              (16, 64)),
                           "model.layers.2.mlp.experts.3.up_proj.weight"),
    "expert_out_of_range": ("qwen3_next", _set("model.layers.2.mlp.experts.8.up_proj.weight",
                                               (32, 64)),
                            "model.layers.2.mlp.experts.8.up_proj.weight"),
    "unexpected": ("qwen3_5_text", _set("model.layers.0.mlp.bias", (64,)),
                   "model.layers.0.mlp.bias"),
    "gdn_tensor_on_attention_layer": ("qwen3_5_text",
                                      _set("model.layers.3.linear_attn.A_log", (4,)),
                                      "model.layers.3.linear_attn.A_log"),
    "duplicate_prefix": ("qwen3_5_text", _set(WRAPPER + "norm.weight", (64,)), "model.norm.weight"),
    "duplicate_split_and_grouped": ("qwen3_next",
                                    _set("model.layers.0.linear_attn.in_proj_z.weight", (64, 64)),
                                    "model.layers.0.linear_attn.in_proj_"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_checkpoint_is_an_error(ckpt, tmp_path, case):
    kind, edit, name = CORRUPTIONS[case]
    path = rewrite(ckpt(kind), tmp_path / case, edit)
    with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
        load(path)


def test_every_expert_piece_must_be_present(ckpt, tmp_path):
    path = rewrite(ckpt("qwen3_next"), tmp_path / "gap",
                   _drop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(WeightLoadError) as err:
        load(path)
    assert "model.layers.2.mlp.experts.gate_up_proj" in str(err.value)
    assert "experts.5.up_proj.weight" in str(err.value)


def test_per_expert_and_packed_together_is_a_duplicate(ckpt, tmp_path):
    config = read_model_config(ckpt("qwen3_5_moe_text"))
    e, im, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    path = rewrite(ckpt("qwen3_5_moe_text"), tmp_path / "both",
                   _set("model.layers.1.mlp.experts.down_proj", (e, h, im)))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\."):
        load(path)


def test_no_checkpoint_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    config = read_model_config(tmp_path)
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        load_weights({}, tmp_path, config)
