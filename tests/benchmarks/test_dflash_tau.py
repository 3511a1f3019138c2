"""The τ benchmark: its figures come from the engine's own accept lengths and outputs."""

from __future__ import annotations

import json

from benchmarks.dflash_tau import TauConfig, timed_generate, as_json, format_table, main, run_tau
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.model.load import load_model
from common.sampling import SamplingParams


def test_tau_rows_and_speed(tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"text": "def add(a, b):\n    return a + b\n" * 6}) + "\n")
    config = TauConfig(model="tiny", draft="tiny", data=str(data), blocks=(4, 8),
                       temperatures=(0.0, 0.7), num_prompts=3, prompt_tokens=16,
                       max_new_tokens=12, speed_batches=(2,))
    report = run_tau(config, progress=False)
    assert [(r.block_size, r.temperature) for r in report.rows] == [
        (4, 0.0), (4, 0.7), (8, 0.0), (8, 0.7)]
    for r in report.rows:
        assert 1.0 <= r.tau <= r.block_size and r.steps > 0 and 0 < r.tokens <= 3 * 12
        # greedy speculation gives plain decoding's tokens (lossless)
        assert r.identical == (1.0 if r.temperature == 0 else None)
    (speed,) = report.speed
    assert speed.batch == 2 and speed.block_size == 8 and speed.plain_tokens_per_s > 0
    assert speed.speedup == speed.dflash_tokens_per_s / speed.plain_tokens_per_s
    assert speed.plain_decode_tokens_per_s > 0 and speed.dflash_decode_tokens_per_s > 0
    assert speed.decode_speedup == (speed.dflash_decode_tokens_per_s
                                    / speed.plain_decode_tokens_per_s)
    # a batch takes at least as many steps as its requests do on average
    assert speed.dflash_batch_steps >= speed.dflash_row_steps > 0
    table = format_table(report)
    assert "tau" in table.splitlines()[0] and "speedup" in table and "decode x" in table
    assert "steps batch/row" in table
    assert as_json(report)["tau"][0]["block_size"] == 4


def test_cli_prints_the_table_last_and_writes_json(tmp_path, capsys):
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"text": "import os\nprint(os.getcwd())\n" * 4}) + "\n")
    out = tmp_path / "tau.json"
    assert main(["--model", "tiny", "--draft", "tiny", "--data", str(data), "--blocks", "4",
                 "--temperatures", "0", "--num-prompts", "2", "--prompt-tokens", "8",
                 "--max-new-tokens", "6", "--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0].split()[:3] == ["block", "temp", "tau"] and len(printed) == 2
    assert json.loads(out.read_text())["tau"][0]["identical"] == 1.0


def test_decode_alone_counts_the_tokens_after_every_first_token():
    engine = LLMEngine(load_model("tiny"), EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=40, num_slots=4)))
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    run = timed_generate(engine, [[3, 4, 5], [6, 7, 8, 9]], params, on_gpu=False)
    assert [len(r.output_ids) for r in run.requests] == [5, 5]
    # both prompts are prefilled in the first step, each giving its first token there
    assert run.decode_tokens == 2 * 5 - 2
    assert run.decode_steps == 5 - 1  # one token a step for each, after the first
    assert 0 < run.decode_seconds < run.seconds
    assert engine.scheduler.num_requests == 0
