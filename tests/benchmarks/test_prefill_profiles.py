"""benchmarks/profile_prefill.py and benchmarks/prefill_gap.py on the CPU: each runs and
reports what it says it measures."""

from __future__ import annotations

import json

from benchmarks import prefill_gap, profile_prefill


def test_profile_prefill_reports_wall_and_host_time(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert profile_prefill.main(["--model", "tiny", "--device", "cpu", "--length", "96",
                                 "--num-pages", "128", "--max-prefill-tokens", "32",
                                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["length"] == 96 and result["wall_ms"] > 0
    assert result["device_busy_ms"] == 0  # no GPU: no device intervals
    assert any(name == "aten::mm" or name.startswith("aten::") for name, _, _ in
               result["host_self_ms"])
    assert capsys.readouterr().out.splitlines()[-1].split()[0] == "96"


def test_prefill_gap_runs_each_case_in_a_process_of_its_own(tmp_path, capsys):
    out = tmp_path / "gap.json"
    assert prefill_gap.main(["--model", "tiny", "--device", "cpu", "--lengths", "40",
                             "--repeats", "1", "--num-pages", "128",
                             "--max-prefill-tokens", "16", "--cases", "engine,worker",
                             "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"engine", "worker"}
    assert all(r["40"]["wall_ms"] > 0 for r in results.values())
    table = capsys.readouterr().out.splitlines()
    assert table[-1].split()[:2] == ["worker", "40"]
