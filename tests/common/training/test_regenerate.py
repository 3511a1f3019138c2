"""Draft training data written by the target: prompts from the data, the engine's continuations."""

from __future__ import annotations

import json

from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.model.load import load_model
from common.sampling import SamplingParams
from common.training.regenerate import RegenerateConfig, provenance_path, regenerate
from common.training.token_data import read_documents
from router.cli import main as flashsplit


def test_continuations_are_the_engines(corpus_dir, tmp_path):
    out = tmp_path / "regen.jsonl"
    result = regenerate(RegenerateConfig(model="tiny", data=str(corpus_dir), out=str(out),
                                         num_prompts=4, prompt_tokens=12, max_new_tokens=10,
                                         temperatures=(0.0, 0.7), max_running=4))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == result["prompts"] == 4
    assert [r["temperature"] for r in rows] == [0.0, 0.7, 0.0, 0.7]
    assert all(r["prompt_tokens"] == 12 and 12 < len(r["token_ids"]) <= 22 for r in rows)
    assert result["generated_tokens"] == sum(len(r["token_ids"]) - 12 for r in rows)
    # a greedy row's continuation is what the engine gives its prompt
    engine = LLMEngine(load_model("tiny"), EngineConfig(cache=CacheConfig(num_pages=64)))
    prompt = rows[0]["token_ids"][:12]
    (req,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=10))
    assert rows[0]["token_ids"][12:] == req.output_ids
    # prompts are windows of the data's tokens
    text = "".join(read_documents(corpus_dir))
    assert bytes(prompt).decode("utf-8", errors="ignore")[2:-2] in text
    assert read_documents(out) == [r["token_ids"] for r in rows]  # train-draft reads it back


def test_waves_write_the_same_continuations(corpus_dir, tmp_path):
    """Prompts admitted a wave at a time get the continuations they get when each is admitted
    as a slot frees: the same prompts, seeds and engine, only the order of admission differs."""
    rows = {}
    for waves in (False, True):
        out = tmp_path / f"regen-{waves}.jsonl"
        result = regenerate(RegenerateConfig(model="tiny", data=str(corpus_dir), out=str(out),
                                             num_prompts=7, prompt_tokens=12, max_new_tokens=9,
                                             temperatures=(0.0, 0.7), max_running=3,
                                             waves=waves))
        assert result["prompts"] == 7
        rows[waves] = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[True] == rows[False]


def test_the_data_records_how_it_was_made_and_the_draft_carries_it(corpus_dir, tmp_path):
    out = tmp_path / "regen.jsonl"
    result = regenerate(RegenerateConfig(model="tiny", data=str(corpus_dir), out=str(out),
                                         num_prompts=2, prompt_tokens=12, max_new_tokens=4,
                                         temperatures=(0.0,), max_running=2))
    record = json.loads(provenance_path(out).read_text())
    assert record["result"] == result and record["config"]["num_prompts"] == 2
    assert record["corpus"] == json.loads((corpus_dir / "manifest.json").read_text())
    draft = tmp_path / "draft"
    assert flashsplit(["train-draft", "--target", "tiny", "--data", str(out), "--out", str(draft),
                       "--steps", "1", "--block-size", "4", "--layers", "1", "--head-dim", "32",
                       "--seq-len", "16", "--batch-size", "1", "--anchors", "2",
                       "--no-progress"]) == 0
    assert json.loads((draft / "provenance.json").read_text())["data_made_by"] == record
