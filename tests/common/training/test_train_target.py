"""The built-in target's training: what it writes, that the project's own model serves it
exactly as transformers computes it, and that it learns."""

from __future__ import annotations

import json

import pytest
import torch

from common.model.load import load_model
from common.tokenizer import load_tokenizer
from common.training.train_target import PYCODER_ARCH, import_transformers, main
from tests.common.model.test_qwen3_5 import forward_all_logits
from tests.common.training.conftest import TINY_ARCH


def test_checkpoint_files_and_provenance(trained_target, corpus_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "provenance.json", "loss.png"):
        assert (trained_target / name).is_file(), name
    config = json.loads((trained_target / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["tie_word_embeddings"]
    p = json.loads((trained_target / "provenance.json").read_text())
    assert p["corpus"] == json.loads((corpus_dir / "manifest.json").read_text())
    assert p["training"]["steps"] == 8 and p["training"]["tokens"] == 8 * 4 * 64
    assert p["architecture"]["hidden_size"] == TINY_ARCH["hidden_size"]
    evals = [e["loss"] for e in p["training"]["eval_loss"]]
    assert len(evals) >= 2 and evals[-1] < evals[0]  # it learns (held-out loss)
    assert p["environment"]["device"] == "cpu"


def test_our_model_serves_it_as_transformers_computes_it(trained_target):
    _, model_cls = import_transformers("cpu")
    hf = model_cls.from_pretrained(str(trained_target), dtype=torch.float32).eval()
    ours = load_model(str(trained_target))
    tok = load_tokenizer(str(trained_target))
    ids = tok.encode("def f(items):\n    return sorted(items)\n")
    assert tok.eos_token_ids == (0,)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = forward_all_logits(ours, [ids])
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4


def test_pycoder_architecture_is_a_servable_config():
    from common.model.family_registry import parse_model_config

    config = parse_model_config({"model_type": "qwen3_5_text", "vocab_size": 8192,
                                **PYCODER_ARCH})
    assert config.full_attention_layers == (3, 7) and config.rotary_dim == 32
    assert config.linear_key_head_dim == config.head_dim == 128  # the GPU kernels' fast path
    # the default shape is the shipped model's, so the rebuild script's default remakes it
    from common.model.registry import PYCODER

    shipped = json.loads((PYCODER.target_dir / "provenance.json").read_text())["architecture"]
    assert {k: shipped[k] for k in PYCODER_ARCH} == PYCODER_ARCH


@pytest.mark.parametrize("name, full, params", [("small_target_arch.json", (2, 5), 7_225_616),
                                                 ("large_target_arch.json", None, None)])
def test_benchmark_target_architectures_are_servable(name, full, params):
    from pathlib import Path

    from common.model.family_registry import parse_model_config

    arch = json.loads((Path(__file__).parents[3] / "benchmarks" / name).read_text())
    config = parse_model_config({"model_type": "qwen3_5_text", "vocab_size": 8192, **arch})
    assert config.linear_key_head_dim == config.head_dim == 128
    if full is not None:
        assert config.full_attention_layers == full
    if params is not None:  # as its run recorded (docs/training.md), on no device
        config_cls, model_cls = import_transformers("cpu")
        with torch.device("meta"):
            model = model_cls(config_cls(**arch, vocab_size=8192))
        assert sum(p.numel() for p in model.parameters()) == params


def test_cli_needs_a_budget(tmp_path):
    with pytest.raises(SystemExit):
        main(["--corpus", str(tmp_path), "--tokenizer", str(tmp_path), "--out", str(tmp_path)])


def test_hiding_fla_from_transformers_leaves_it_importable_afterwards():
    import sys

    import_transformers("cpu")
    # a None entry would make every later `import fla...` in this process fail, the serving
    # kernels' included
    assert sys.modules.get("fla", "absent") is not None


@pytest.mark.parametrize("keep_best", [True, False])
def test_saves_the_weights_of_the_best_held_out_evaluation(corpus_dir, tokenizer_dir, tmp_path,
                                                          monkeypatch, keep_best):
    from safetensors.torch import load_file

    from common.training import train_target as module
    from common.training.schedule import Budget

    scripted, seen = iter([3.0, 1.0, 2.0, 4.0]), []

    def scripted_loss(model, windows, **kw):  # the second evaluation is the best
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return next(scripted)

    monkeypatch.setattr(module, "mean_loss", scripted_loss)
    out = tmp_path / "target"
    module.train_target(module.TargetTrainConfig(
        corpus=str(corpus_dir), tokenizer=str(tokenizer_dir), out=str(out),
        budget=Budget(max_steps=8), arch=dict(TINY_ARCH), seq_len=64, batch_size=4, lr=1e-2,
        eval_windows=8, eval_points=4, device="cpu", save_dtype="float32", keep_best=keep_best,
        progress=False))
    assert len(seen) == 4
    expected = seen[1] if keep_best else seen[-1]
    saved = load_file(out / "model.safetensors")
    assert not torch.equal(seen[1]["model.norm.weight"], seen[-1]["model.norm.weight"])
    for name, value in saved.items():
        assert torch.equal(value, expected[name]), name
    p = json.loads((out / "provenance.json").read_text())
    steps = [e["step"] for e in p["training"]["eval_loss"]]
    assert p["training"]["saved_weights"] == {"step": steps[1] if keep_best else 8,
                                              "eval_loss": 1.0 if keep_best else 4.0}
