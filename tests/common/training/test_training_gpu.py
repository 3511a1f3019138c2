"""Training on a CUDA device, as the built-in model's rebuild runs it: transformers (with fla's
GDN kernels when installed) for the target, the project's GPU kernels for the captured hidden
states, and greedy speculation with the trained draft equal to plain greedy decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.model.dflash import load_draft
from common.model.load import load_model
from common.model.kernels import select_kernels
from common.sampling import SamplingParams
from common.training.draft_config import DraftArch, DraftTrainConfig
from common.training.schedule import Budget
from common.training.train_draft import train_draft
from common.training.train_target import PYCODER_ARCH

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[3]

# the built-in model's layer shapes (128-dim heads), fewer and narrower layers
ARCH = {**PYCODER_ARCH, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]}


@pytest.fixture(scope="module")
def cuda_target(corpus_dir, tokenizer_dir, tmp_path_factory):
    """Trained by the command the rebuild script runs, in a fresh interpreter: there
    transformers routes the GDN layers to fla's kernels (this test process keeps fla away from
    transformers for the CPU oracles)."""
    out = tmp_path_factory.mktemp("gpu-target")
    arch = out / "arch.json"
    arch.write_text(json.dumps(ARCH))
    subprocess.run([sys.executable, "-m", "common.training.train_target", "--corpus",
                    str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                    "--arch", str(arch), "--steps", "30", "--batch-size", "8", "--seq-len", "128",
                    "--lr", "3e-3", "--device", "cuda", "--save-dtype", "float32",
                    "--no-progress"], check=True, cwd=REPO, timeout=600)
    return out, json.loads((out / "provenance.json").read_text())


def test_target_trains_and_serves_on_cuda(cuda_target):
    out, result = cuda_target
    evals = [e["loss"] for e in result["training"]["eval_loss"]]
    assert all(v == v for v in evals) and evals[-1] < evals[0]
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_text"
    ours = load_model(str(out), device="cuda", kernels=select_kernels("gpu"))
    reference = load_model(str(out))  # the CPU reference kernels
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    prompt = [[5, 17, 200, 31, 9, 64, 120, 3]]
    engine = LLMEngine(ours, EngineConfig(device="cuda"))
    engine.warmup()  # decode replayed from CUDA graphs, as a worker serves
    got = engine.generate(prompt, params)
    want = LLMEngine(reference, EngineConfig()).generate(prompt, params)
    assert got[0].output_ids == want[0].output_ids


def test_draft_trains_on_cuda_and_greedy_speculation_is_lossless(cuda_target, corpus_dir,
                                                                   tmp_path):
    out, _ = cuda_target
    result = train_draft(DraftTrainConfig(
        target=str(out), data=str(corpus_dir), out=str(tmp_path), budget=Budget(max_steps=40),
        arch=DraftArch(block_size=8, num_layers=2), seq_len=128, batch_size=8, num_anchors=8,
        device="cuda", progress=False))
    history = result["training"]["history_every_n_steps"]["values"]
    assert history[-1][1] < history[0][1]
    target = load_model(str(out), device="cuda", kernels=select_kernels("gpu"))
    draft = load_draft(str(tmp_path), target)
    prompts = [[5, 17, 200, 31, 9, 64, 120, 3], [40, 41, 42], [7] * 12]
    params = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    config = EngineConfig(device="cuda", cache=CacheConfig(num_pages=256))
    engines = [LLMEngine(target, config), LLMEngine(target, config, draft=draft)]
    for engine in engines:
        engine.warmup()  # decode, draft and verify forwards replayed from CUDA graphs
    plain, spec = (engine.generate(prompts, params) for engine in engines)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert all(r.accept_lengths for r in spec)  # every request ran DFLASH steps
