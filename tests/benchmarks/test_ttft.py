"""benchmarks/ttft.py on the CPU with the tiny model: the in-process engine and one cluster,
the same first tokens, every case timed and written to the JSON (first requests included)."""

from __future__ import annotations

import json

from benchmarks.ttft import main


def test_in_process_and_split_give_the_same_first_tokens_and_every_case_a_time(tmp_path,
                                                                               capsys):
    out = tmp_path / "ttft.json"
    assert main(["--model", "tiny", "--device", "cpu", "--lengths", "16,40", "--repeats", "1",
                 "--concurrent", "2", "--concurrent-len", "16", "--concurrent-new", "4",
                 "--num-pages", "64", "--max-prefill-tokens", "32", "--transports", "auto",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    local, split = result["in_process"], result["disaggregated"]["auto"]
    for case in ("16", "40", "concurrent_s", "first_request_s"):
        assert local[case] > 0 and split[case] > 0
    assert split["first_tokens"] == local["first_tokens"]
    # the prefill worker's phases reach the benchmark through the router's completions
    timings = split["timings"]["40"]
    assert 0 < timings["prefill_call_queue_s"] < timings["router_ttft_s"]
    assert split["concurrent_decode_steps"] > 0
    printed = capsys.readouterr().out
    assert "first tokens equal in process: True" in printed
    assert "first request after start (16 tokens)" in printed
