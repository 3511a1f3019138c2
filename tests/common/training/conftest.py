"""Small training inputs shared by the training tests: a corpus of real Python files, a BPE
tokenizer trained on it, a target trained on it for a few steps and a draft for that target."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from common.training.bpe import save_tokenizer, train_bpe
from common.training.corpus import CorpusConfig, write_corpus
from common.training.schedule import Budget

# ten standard-library modules, copied as pkg/m0.py .. pkg/m9.py: m0, m3, m7 and m8 are the
# held-out files at 300 per mille (the split hashes the relative path)
SOURCES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "bisect.py",
           "heapq.py", "colorsys.py", "fnmatch.py", "keyword.py", "shlex.py")
HELD_OUT = {"pkg/m0.py", "pkg/m3.py", "pkg/m7.py", "pkg/m8.py"}
EVAL_PERMILLE = 300

TINY_ARCH = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 1024,
}


@pytest.fixture(scope="session")
def source_root(tmp_path_factory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path_factory.mktemp("lib")
    (root / "pkg").mkdir()
    for i, name in enumerate(SOURCES):
        (root / "pkg" / f"m{i}.py").write_text((stdlib / name).read_text(encoding="utf-8"))
    return root


@pytest.fixture(scope="session")
def corpus_dir(source_root, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    write_corpus(out, CorpusConfig(root=source_root, eval_permille=EVAL_PERMILLE))
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(corpus_dir, tmp_path_factory) -> Path:
    from common.training.token_data import read_documents

    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_bpe(read_documents(corpus_dir), vocab_size=512), out,
                   model_max_length=1024)
    return out


@pytest.fixture(scope="session")
def trained_target(corpus_dir, tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny target trained for 8 steps (CPU, fp32 saved: exact comparisons)."""
    from common.training.train_target import TargetTrainConfig, train_target

    out = tmp_path_factory.mktemp("target")
    train_target(TargetTrainConfig(
        corpus=str(corpus_dir), tokenizer=str(tokenizer_dir), out=str(out),
        budget=Budget(max_steps=8), arch=dict(TINY_ARCH), seq_len=64, batch_size=4, lr=1e-2,
        eval_windows=8, eval_points=4, device="cpu", save_dtype="float32", progress=False))
    return out
