"""The sampler benchmark times each draw it reports, for every size asked."""

from __future__ import annotations

import json

from benchmarks import sampler_host


def test_a_row_per_size_with_every_timing(tmp_path, capsys):
    out = tmp_path / "sampler.json"
    assert sampler_host.main(["--rows", "1,3", "--vocab", "16", "--repeats", "2", "--block", "4",
                              "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["vocab"]) for r in rows] == [(1, 16), (3, 16)]
    for r in rows:
        assert r["seeded_ms"] > 0 and r["unseeded_ms"] > 0 and r["per_row_multinomial_ms"] > 0
    accepts = json.loads(out.read_text())["acceptance"]
    assert [(r["rows"], r["vocab"], r["block"]) for r in accepts] == [(1, 16, 4), (3, 16, 4)]
    assert all(r["batch_ms"] > 0 and r["row_by_row_ms"] > 0 for r in accepts)
    assert capsys.readouterr().out.splitlines()[-1].startswith("wrote")
