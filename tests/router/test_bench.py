"""``flashsplit bench``: its parts on their own, and whole runs against a router (with fake
worker processes) through both backends."""

from __future__ import annotations

import json
import math

import pytest

from router.bench.backends import RequestResult
from router.bench.config import BenchConfig, LengthDist, Load, parse_loads
from router.bench.metrics import max_in_flight, summarize
from router.bench.workload import arrival_offsets, build_requests, load_prompts
from router.cli import main
from router.cluster import Cluster, ClusterConfig

FAKES = dict(prefill_module="tests.router.fake_prefill", decode_module="tests.router.fake_decode")


def test_lengths_and_loads():
    assert LengthDist.parse("12") == LengthDist(12, 12)
    assert LengthDist.parse("4:9") == LengthDist(4, 9)
    for bad in ("0", "9:4", "x", "1:y"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)
    assert parse_loads("1,4", None) == (Load(concurrency=1), Load(concurrency=4))
    rates = parse_loads(None, "2,inf")
    assert rates[0].request_rate == 2 and math.isinf(rates[1].request_rate)
    assert rates[1].label == "rate inf" and rates[0].as_dict() == {"request_rate": 2.0}
    for c, r in (("1", "2"), ("0", None), (None, "-1")):
        with pytest.raises(ValueError):
            parse_loads(c, r)
    with pytest.raises(ValueError, match="chat needs --backend openai"):
        BenchConfig(backend="grpc", url="x", loads=(Load(concurrency=1),), endpoint="chat")


def test_workload_is_reproducible_and_poisson(tmp_path):
    config = BenchConfig(backend="grpc", url="x", loads=(Load(concurrency=1),), num_prompts=50,
                         input_len=LengthDist(3, 9), output_len=LengthDist(5, 5), seed=3)
    reqs = build_requests(config)
    assert reqs == build_requests(config)
    assert all(3 <= len(r.prompt) <= 9 and r.max_tokens == 5 for r in reqs)
    assert len({len(r.prompt) for r in reqs}) > 1 and [r.seed for r in reqs] == list(range(3, 53))
    offsets = arrival_offsets(2000, 10.0, seed=1)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] / len(offsets) == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets(3, float("inf"), 1) == [0.0] * 3
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b"}\n{"text": "c"}\n')
    assert load_prompts(str(prompts)) == ["a b", "c"]
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["one", "two"]


def test_summary_percentiles_throughput_and_in_flight():
    results = [RequestResult(ok=True, prompt_tokens=4, output_tokens=5, ttft_s=0.1 * (i + 1),
                             itl_s=[0.01] * 4, e2e_s=0.1 * (i + 1) + 0.04, start_s=i * 0.5)
               for i in range(10)]
    results.append(RequestResult(ok=False, error="UNAVAILABLE: x", start_s=0.0, e2e_s=0.2))
    s = summarize(results, duration_s=2.0)
    assert (s.completed, s.failed, s.first_error) == (10, 1, "UNAVAILABLE: x")
    assert s.request_throughput == 5.0 and s.output_throughput == 25.0
    assert s.total_throughput == 45.0
    assert s.ttft.p50 == pytest.approx(550.0) and s.ttft.p99 == pytest.approx(991.0)
    assert s.itl.p90 == pytest.approx(10.0) and s.itl.count == 40
    assert s.tpot.mean == pytest.approx(10.0)
    assert max_in_flight(results) == 2  # the failed one overlapped the first


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(router_http_port=0, start_timeout_s=60, **FAKES)
    with Cluster(config) as c:
        yield c


@pytest.mark.parametrize("backend,load", [("grpc", ["--concurrency", "1,3"]),
                                          ("openai", ["--request-rate", "40,inf"])])
def test_bench_runs_and_reports(cluster, tmp_path, capsys, backend, load):
    url = cluster.router_address if backend == "grpc" else cluster.http_url
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    code = main(["bench", "--backend", backend, "--url", url, *load, "--num-prompts", "6",
                 "--input-len", "4:8", "--output-len", "7", "--json", str(out_json),
                 "--plot", str(out_png), "--no-progress"])
    assert code == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-4].startswith("| load") and len(table[-2:]) == 2  # the table comes last
    report = json.loads(out_json.read_text())
    assert report["model"] == "tiny" and report["config"]["backend"] == backend
    assert len(report["points"]) == 2
    for point in report["points"]:
        s = point["summary"]
        assert (s["completed"], s["failed"]) == (6, 0)
        assert s["output_tokens"] == 6 * 7 and s["request_throughput"] > 0
        assert 0 < s["ttft"]["p50"] <= s["ttft"]["p99"] <= s["e2e"]["p99"]
        assert s["itl"]["count"] > 0 and len(point["requests"]) == 6
    if backend == "grpc":
        assert [p["summary"]["max_in_flight"] for p in report["points"]] == [1, 3]
        assert all(r["prompt_tokens"] in range(4, 9) for r in report["points"][0]["requests"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_chat_endpoint_and_a_failing_server(cluster, tmp_path, capsys):
    code = main(["bench", "--backend", "openai", "--endpoint", "chat", "--url", cluster.http_url,
                 "--num-prompts", "2", "--output-len", "3", "--json", "", "--plot", "",
                 "--no-progress"])
    assert code == 0 and "| concurrency 1 |" in capsys.readouterr().out
    code = main(["bench", "--backend", "openai", "--url", cluster.http_url, "--model", "nope",
                 "--num-prompts", "1", "--json", "", "--plot", "", "--no-progress"])
    assert code == 1 and "does not exist" in capsys.readouterr().err
