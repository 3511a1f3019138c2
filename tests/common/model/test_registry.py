"""Built-in checkpoint names resolve to their directories everywhere a model or draft loads."""

from __future__ import annotations

import shutil

import pytest
import torch

from common.chat_template import load_chat_template
from common.model import registry
from common.model.dflash import load_draft
from common.model.load import load_model, weights_identity
from common.model.registry import load_config
from common.tokenizer import HFTokenizer, load_tokenizer
from common.training.bpe import save_tokenizer, train_bpe
from tests.common.model.checkpoints import make_checkpoint
from tests.common.model.draft_checkpoints import make_draft_checkpoint


@pytest.fixture
def weights_dir(tmp_path, monkeypatch):
    """A weights directory holding a random 'pycoder' target (with a tokenizer) and draft."""
    monkeypatch.setattr(registry, "WEIGHTS_DIR", tmp_path)
    target = make_checkpoint("qwen3_5_text", tmp_path / "pycoder", seed=3)
    tok = train_bpe(["def f(x):\n    return x + 1\n"] * 20, vocab_size=256 + 8)
    save_tokenizer(tok, target, model_max_length=512)
    config = load_config(str(target))
    make_draft_checkpoint(tmp_path / "pycoder-dflash", config, block_size=4, mask_token_id=1,
                          target_layer_ids=[1, 2])
    return tmp_path


def test_names_resolve_and_load(weights_dir):
    path = str(weights_dir / "pycoder")
    assert registry.resolve_model("pycoder") == path
    assert registry.resolve_draft("pycoder") == str(weights_dir / "pycoder-dflash")
    assert registry.resolve_model("tiny") == "tiny"  # built in code, not a directory
    assert registry.resolve_model("/some/dir") == "/some/dir"

    by_name, by_path = load_model("pycoder"), load_model(path)
    for (n1, p1), (n2, p2) in zip(by_name.named_parameters(), by_path.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert load_config("pycoder") == load_config(path)
    assert weights_identity("pycoder") == weights_identity(path)
    assert isinstance(load_tokenizer("pycoder"), HFTokenizer)
    assert load_chat_template("pycoder") is None  # a code model ships no chat template
    draft = load_draft("pycoder", by_name)
    assert draft.config.block_size == 4 and draft.config.target_layer_ids == (1, 2)


def test_missing_weights_say_how_to_build_them(weights_dir):
    shutil.rmtree(weights_dir / "pycoder")
    for call in (lambda: load_model("pycoder"), lambda: load_tokenizer("pycoder"),
                 lambda: registry.resolve_model("pycoder")):
        with pytest.raises(FileNotFoundError, match="train_builtin_gpu.sh"):
            call()
    shutil.rmtree(weights_dir / "pycoder-dflash")
    with pytest.raises(FileNotFoundError, match="draft of built-in model 'pycoder'"):
        load_draft("pycoder", load_model("tiny"))


def test_demo_prompts_and_default():
    assert registry.demo_prompts_for("pycoder") == registry.PYCODER.demo_prompts
    assert all(p.strip() for p in registry.PYCODER.demo_prompts)
    assert registry.demo_prompts_for("tiny") is None
    # the default is a trained checkpoint that ships in the tree, target and draft
    checkpoint = registry.BUILTIN_CHECKPOINTS[registry.DEFAULT_MODEL]
    assert (checkpoint.target_dir / "model.safetensors").is_file()
    assert (checkpoint.draft_dir / "model.safetensors").is_file()
