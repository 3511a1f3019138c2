"""benchmarks/dflash_serving.py: one cluster with a draft, each concurrency run with
speculation off and on, τ read from the decode worker (the built-in tiny pair, on the CPU)."""

from __future__ import annotations

import pytest

from benchmarks.dflash_serving import ServingConfig, format_table, run


@pytest.fixture
def held_out(tmp_path):
    path = tmp_path / "held_out.txt"
    path.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    return str(path)


def test_each_concurrency_runs_plain_then_speculative_on_the_same_cluster(held_out):
    config = ServingConfig(model="tiny", draft="tiny", data=held_out, concurrency=(1, 2),
                           prompts_per_slot=1, min_requests=2, prompt_tokens=16, output_len=8)
    rows = run(config, progress=lambda line: None)
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert [r["requests"] for r in rows] == [2, 2]  # at least min_requests at 1 in flight
    for r in rows:
        plain, dflash = r["plain"], r["dflash"]
        # exactly the requested tokens per measured request, both ways
        assert plain["output_tokens"] == dflash["output_tokens"] == r["requests"] * 8
        assert plain["tau"] is None  # speculation off: the draft took no step
        assert 1.0 <= dflash["tau"] <= 16
        assert r["speedup"] == pytest.approx(dflash["output_tokens_per_s"]
                                             / plain["output_tokens_per_s"])
        assert r["decode_speedup"] == pytest.approx(plain["tpot_p50_ms"] / dflash["tpot_p50_ms"])
        for arm in (plain, dflash):
            # the decode worker's mean engine step, in ms: one step is within the arm's time
            seconds = arm["output_tokens"] / arm["output_tokens_per_s"]
            assert 0 < arm["step_ms"] < seconds * 1e3
    table = format_table(rows)
    header = table.splitlines()[0]
    assert header.split()[0] == "concurrency" and len(table.splitlines()) == 3
    # TTFT beside TPOT: a queue in front of one half shows there, not in TPOT
    assert "TTFT plain ms" in header and "TTFT DFLASH ms" in header
    assert "decode x" in header and len(table.splitlines()[1].split()) == 12
    assert "step plain ms" in header and "step DFLASH ms" in header
