"""router/cluster.py and `flashsplit up` / `generate --router`, with fake worker processes."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc
from router.cluster import Cluster, ClusterConfig, ClusterError
from router.remote import generate, request_to_pb
from tests.router.fakes import REPLY_IDS, REPLY_TEXT

FAKES = dict(prefill_module="tests.router.fake_prefill", decode_module="tests.router.fake_decode")


def port_open(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def test_cluster_serves_generate_cli_and_survives_a_killed_worker():
    config = ClusterConfig(num_prefill=2, num_decode=1, start_timeout_s=60,
                           router_args=("--poll-interval", "0.1"), **FAKES)
    with Cluster(config) as c:
        assert [w.kind for w in c.workers] == ["prefill", "prefill", "decode"]
        assert all(w.address and w.alive() for w in c.workers)

        out = subprocess.run(
            [sys.executable, "-m", "router.cli", "generate", "--router", c.router_address,
             "--prompt", "Hi", "--max-new-tokens", "100", "--json"],
            capture_output=True, text=True, timeout=30, check=True)
        result = json.loads(out.stdout)
        assert result["text"] == REPLY_TEXT and result["finish_reason"] == "stop"
        assert result["prompt_tokens"] == 2 and len(result["token_ids"]) == len(REPLY_TEXT.encode())
        assert len(result["inter_token_latencies_s"]) == len(result["token_ids"]) - 1
        assert result["time_to_first_token_s"] > 0 and len(result["accept_lengths"]) > 0

        victim = c.workers[0]
        victim.popen.kill()
        victim.popen.wait()

        async def several():
            return [await generate(c.router_address,
                                   request_to_pb(token_ids=[1, 2]), timeout_s=10)
                    for _ in range(4)]
        # Whether or not the registry noticed yet, every request lands on the live worker.
        for done in asyncio.run(several()):
            assert done.finish_reason == "length" and len(done.token_ids) == 16
    assert not any(p.alive() for p in c.workers + [c.router])


def test_mem_fraction_is_split_between_the_workers_of_each_device():
    """(router/memory_shares.py has the rule; this is the plumbing to the processes.)"""
    config = ClusterConfig(num_prefill=1, num_decode=1, worker_args=("--device", "cuda"),
                           mem_fraction=0.9, start_timeout_s=60, **FAKES)
    with Cluster(config) as c:
        given = [float(w.args[w.args.index("--mem-fraction") + 1]) for w in c.workers]
    assert given == [0.45, 0.45]  # both on the one GPU


def test_cpu_workers_share_the_hosts_cpus_unless_given_a_count():
    """(router/cpu_shares.py has the rule; this is the plumbing to the processes.)"""
    from common.cpu_threads import available_cpus

    share = max(1, available_cpus() // 2)
    with Cluster(ClusterConfig(num_prefill=1, num_decode=1, start_timeout_s=60,
                               **FAKES)) as c:
        given = [w.args[w.args.index("--cpu-threads") + 1] for w in c.workers]
    assert given == [str(share), str(share)]
    with Cluster(ClusterConfig(num_prefill=1, num_decode=1, worker_args=("--device", "cuda"),
                               start_timeout_s=60, **FAKES)) as c:
        assert not any("--cpu-threads" in w.args for w in c.workers)
    with Cluster(ClusterConfig(num_prefill=1, num_decode=1, worker_args=("--cpu-threads", "3"),
                               start_timeout_s=60, **FAKES)) as c:
        assert all(w.args.count("--cpu-threads") == 1 for w in c.workers)


def test_worker_dying_at_start_stops_everything_and_reports_its_stderr():
    config = ClusterConfig(num_prefill=1, num_decode=2, worker_args=("--fail-at-start",),
                           start_timeout_s=60, stop_grace_s=2, **FAKES)
    cluster = Cluster(config)
    with pytest.raises(ClusterError, match="told to fail at start") as err:
        cluster.start()
    assert "prefill-0 exited with status 1" in str(err.value)
    assert cluster.router is None
    assert not any(w.alive() for w in cluster.workers)


def test_up_prints_the_router_address_and_stops_cleanly_on_sigint():
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "up", "--quiet", "--model", "tiny", "--prefill-module",
         FAKES["prefill_module"], "--decode-module", FAKES["decode_module"]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("router listening on "), proc.stderr.read()
        address = line.split()[-1]
        done = asyncio.run(generate(address, request_to_pb(text="Hi"), timeout_s=10))
        assert tuple(done.token_ids) == REPLY_IDS[:16]

        async def workers():
            async with grpc.aio.insecure_channel(address) as ch:
                r = await generation_pb2_grpc.GenerationStub(ch).ListWorkers(
                    generation_pb2.ListWorkersRequest(), timeout=5)
                return [w.address for w in r.workers]
        addresses = asyncio.run(workers()) + [address]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert not any(port_open(a) for a in addresses)
    finally:
        if proc.poll() is None:
            proc.terminate()  # lets `up` stop its children too
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_up_flags_become_the_cluster_config():
    from router.cli import build_parser, cluster_config_from_args

    args = build_parser().parse_args(
        ["up", "--prefill-workers", "2", "--port", "7000", "--device", "cuda:0,cuda:1",
         "--dtype", "bfloat16", "--num-pages", "4096", "--max-running-requests", "8"])
    config = cluster_config_from_args(args)
    assert (config.num_prefill, config.num_decode, config.router_port) == (2, 1, 7000)
    assert config.devices == ("cuda:0", "cuda:1")
    assert config.worker_args == ("--dtype", "bfloat16", "--num-pages", "4096",
                                  "--max-running-requests", "8")
    assert config.prefill_module == "prefill_service" and config.echo_logs
    assert config.router_args == ()
    late = cluster_config_from_args(build_parser().parse_args(
        ["up", "--max-prompt-tokens", "64", "--first-token-after-handoff"]))
    assert late.router_args == ("--max-prompt-tokens", "64", "--first-token-after-handoff")
    assert not config.mps
    assert cluster_config_from_args(build_parser().parse_args(["up", "--mps"])).mps
    graphs = cluster_config_from_args(build_parser().parse_args(
        ["up", "--decode-tp", "2", "--tp-cuda-graphs"]))
    assert "--tp-cuda-graphs" in graphs.worker_args
    ahead = cluster_config_from_args(build_parser().parse_args(
        ["up", "--draft", "tiny", "--speculative-ahead", "step"]))
    assert ahead.worker_args == ("--draft", "tiny", "--speculative-ahead", "step")
    threads = cluster_config_from_args(build_parser().parse_args(["up", "--cpu-threads", "3"]))
    assert threads.worker_args == ("--cpu-threads", "3")  # then no share is added
    limit = cluster_config_from_args(build_parser().parse_args(
        ["up", "--draft", "tiny", "--speculative-disable-by-batch-size", "16"]))
    assert limit.worker_args == ("--draft", "tiny", "--speculative-disable-by-batch-size", "16")


def test_mps_cluster_starts_its_workers_as_clients_of_its_own_daemon(tmp_path, monkeypatch):
    from tests.common.test_mps import fake_control

    log = fake_control(tmp_path, monkeypatch)
    config = ClusterConfig(num_prefill=1, num_decode=1, start_timeout_s=60, mps=True, **FAKES)
    with Cluster(config) as c:
        pipes = set()
        for w in c.workers:
            env = dict(item.split("=", 1) for item in
                       Path(f"/proc/{w.pid}/environ").read_text().split("\0") if "=" in item)
            pipes.add(env["CUDA_MPS_PIPE_DIRECTORY"])
        (pipe,) = pipes  # one daemon for all workers
        assert Path(pipe).is_dir()
        assert log.read_text().splitlines() == [f"args=-d pipe={pipe} stdin="]
    # told to quit once the workers had ended, and its directories gone
    assert log.read_text().splitlines()[1:] == [f"args= pipe={pipe} stdin=quit"]
    assert not Path(pipe).exists()


def test_mps_cluster_without_the_control_program_fails_before_any_worker(tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    cluster = Cluster(ClusterConfig(start_timeout_s=60, mps=True, **FAKES))
    with pytest.raises(ClusterError, match="--mps: .*not on PATH"):
        cluster.start()
    assert cluster.workers == [] and cluster.router is None
