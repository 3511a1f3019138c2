"""benchmarks/ttft.py on the CPU with the tiny model: the in-process engine and one cluster,
the same first tokens, every case timed and written to the JSON (first requests included)."""

from __future__ import annotations

import json

import pytest

from benchmarks.ttft import main, router_args, transport_args


def test_in_process_and_split_give_the_same_first_tokens_and_every_case_a_time(tmp_path,
                                                                               capsys):
    out = tmp_path / "ttft.json"
    assert main(["--model", "tiny", "--device", "cpu", "--lengths", "16,40", "--repeats", "1",
                 "--concurrent", "2", "--concurrent-len", "16", "--concurrent-new", "4",
                 "--num-pages", "64", "--max-prefill-tokens", "32", "--transports", "auto,auto/late",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    local, split = result["in_process"], result["disaggregated"]["auto"]
    for case in ("16", "40", "concurrent_s", "first_request_s"):
        assert local[case] > 0 and split[case] > 0
    assert split["first_tokens"] == local["first_tokens"]
    # the same tokens with the first one from decode; the second token always comes later
    late = result["disaggregated"]["auto/late"]
    assert late["first_tokens"] == local["first_tokens"]
    for timed in (split, late):
        assert all(timed["second_token_s"][n] > timed[n] for n in ("16", "40"))
    # the prefill worker's phases reach the benchmark through the router's completions
    timings = split["timings"]["40"]
    assert 0 < timings["prefill_call_queue_s"] < timings["router_ttft_s"]
    assert split["concurrent_decode_steps"] > 0
    printed = capsys.readouterr().out
    assert "first tokens equal in process: True" in printed
    assert "first request after start (16 tokens)" in printed


@pytest.mark.parametrize("spec,workers,prefill,router", [
    ("auto", ("--handoff-transport", "auto"), (), ()),
    ("tcp:2/late", ("--handoff-transport", "tcp"), ("--handoff-tcp-connections", "2"),
     ("--first-token-after-handoff",)),
    ("stream+thread", ("--handoff-transport", "stream"), ("--handoff-sender", "thread"), ()),
    ("tcp:1+process/late", ("--handoff-transport", "tcp"),
     ("--handoff-tcp-connections", "1", "--handoff-sender", "process"),
     ("--first-token-after-handoff",)),
])
def test_a_transports_entry_gives_each_process_its_flags(spec, workers, prefill, router):
    assert transport_args(spec) == (workers, prefill) and router_args(spec) == router


def test_a_connection_count_is_only_for_tcp():
    with pytest.raises(ValueError, match="only tcp"):
        transport_args("auto:2/late")
