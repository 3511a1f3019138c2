"""Workers with ``--tp``, through real processes: router -> prefill -> decode gives the TP 1
in-process greedy tokens whatever the two ends' parallel sizes, and every worker's pools end
full, over per-rank streams (each rank sends or lands its own heads) and through rank 0
(``--tp-handoff leader``); a rank or a worker that dies mid-stream leaves nothing held on the
other side. The built-in ``tiny`` model splits at 2 (4 query heads over 2 KV
heads, 4 GDN value heads over 2 key heads) and not at 3."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys

import pytest

from common.model.load import load_model
from router.cli import build_parser, cluster_config_from_args
from router.cluster import Cluster, ClusterConfig
from tests.router.test_end_to_end import (CHUNKED, generate_all, local_greedy, wait_all_free,
                                          worker_load)

# a prompt within one chunk and one page, and one over several chunks and pages
PROMPTS = [[5, 17, 200], [(i * 37 + 11) % 256 for i in range(23)]]


@pytest.fixture(scope="module")
def expected():
    return local_greedy(load_model("tiny"), PROMPTS)


def run_cluster(config: ClusterConfig):
    """Generate PROMPTS through ``config``'s cluster: outputs, every worker's load once its
    pools drained, and each kind's log."""
    with Cluster(config) as cluster:
        outs = asyncio.run(generate_all(cluster.router_address, PROMPTS))
        reports = asyncio.run(wait_all_free(cluster))
        logs = {w.kind: w.stderr_tail(200) for w in cluster.workers}
    assert all(r.free_pages == r.total_pages and r.free_slots == r.total_slots for r in reports)
    return outs, logs


@pytest.mark.parametrize("prefill_tp,decode_tp,path", [
    # 2 -> 2 over per-rank streams: test_pools_sized_by_memory_with_tp_give_tp1_tokens
    (2, 1, "ranks"), (1, 2, "ranks"),
    # decode's 4 ranks: KV and GDN key heads replicated on pairs of ranks
    (2, 4, "ranks"),
    (2, 1, "leader"), (1, 2, "leader")])
def test_handoff_between_parallel_sizes_gives_tp1_tokens(prefill_tp, decode_tp, path, expected):
    # a sharded end offers (opens) no pools, so the state goes as bytes over TCP: on per-rank
    # streams, or gathered to (scattered from) rank 0
    config = ClusterConfig(model="tiny", worker_args=CHUNKED + ("--tp-handoff", path),
                           prefill_tp=prefill_tp, decode_tp=decode_tp)
    outs, logs = run_cluster(config)
    assert [o.token_ids for o in outs] == expected
    assert "handoff chunks over TCP: listening" in logs["decode"]
    for kind, tp, verb in (("prefill", prefill_tp, "offered"), ("decode", decode_tp, "opened")):
        said = f"the device handoff transport is not {verb}" in logs[kind]
        assert said == (tp > 1), logs[kind]
    said = {"ranks": f"over per-rank streams ({prefill_tp} -> {decode_tp} ranks)",
            "leader": "through this worker's rank 0"}[path]
    assert logs["prefill"].count(said) == len(PROMPTS), logs["prefill"]
    admitted = "on per-rank streams" if path == "ranks" else "through rank 0"
    admitted_lines = [line for line in logs["decode"].splitlines() if "admitted:" in line]
    assert [line.endswith(admitted) for line in admitted_lines] == [True] * len(PROMPTS)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_dflash_across_parallel_sizes_is_lossless(prefill_tp, decode_tp, expected):
    """The draft runs whole on rank 0 of each worker and its context goes in the handoff: greedy
    output with speculation is plain greedy output, every token after the first from a DFLASH
    step, and the chunks went over TCP (a sharded worker offers no pools)."""
    config = ClusterConfig(model="tiny", worker_args=CHUNKED + ("--draft", "tiny"),
                           prefill_tp=prefill_tp, decode_tp=decode_tp)  # auto: per-rank
    with Cluster(config) as cluster:
        outs = asyncio.run(generate_all(cluster.router_address, PROMPTS))
        reports = asyncio.run(wait_all_free(cluster))
        (prefill,) = [w for w in cluster.workers if w.kind == "prefill"]
        load = asyncio.run(worker_load(prefill.address, "prefill", cluster.internal_token))
    assert [o.token_ids for o in outs] == expected
    assert all(o.accept_lengths and sum(o.accept_lengths) >= len(o.token_ids) - 1 for o in outs)
    assert all(r.free_pages == r.total_pages and r.free_slots == r.total_slots for r in reports)
    assert load.counters["handoffs_over_tcp"] == len(PROMPTS)
    assert load.counters["handoffs_over_rank_streams"] == len(PROMPTS)


def test_expert_parallel_workers_hand_off_a_moe_models_state(tmp_path):
    """A MoE checkpoint with its experts placed whole on the prefill worker's two ranks
    (``up --expert-parallel``), and split inside each expert on the decode worker's two:
    router -> prefill -> decode gives the unsharded model's greedy tokens."""
    from tests.common.model.checkpoints import make_checkpoint

    path = make_checkpoint("qwen3_5_moe_text", tmp_path / "moe")
    want = local_greedy(load_model(str(path)), PROMPTS)
    args = build_parser().parse_args(["up", "--model", str(path), "--prefill-tp", "2",
                                      "--expert-parallel", "--page-size", "4"])
    config = cluster_config_from_args(args)
    assert "--expert-parallel" in config.worker_args
    # the decode worker splits each expert instead: only the prefill side gets the flag
    config = dataclasses.replace(config, worker_args=CHUNKED, prefill_args=("--expert-parallel",),
                                 decode_tp=2)
    outs, logs = run_cluster(config)
    assert [o.token_ids for o in outs] == want
    assert "routed experts placed whole" in logs["prefill"]
    assert "tensor parallel over 2 ranks" in logs["decode"]
    assert "routed experts placed whole" not in logs["decode"]


def start_worker(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, "--model", "tiny", "--insecure-no-auth",
                           *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["prefill_service", "decode_service"])
def test_a_tp_that_does_not_divide_the_heads_exits_2(module):
    proc = start_worker(module, "--tp", "3")
    assert proc.returncode == 2
    assert "4 heads cannot be split over 3 ranks" in proc.stderr


def test_pools_sized_by_memory_with_tp_give_tp1_tokens(expected):
    # 64 MiB of the host for the cluster: each worker 32 MiB, each of its ranks 16 MiB
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    config = ClusterConfig(model="tiny", worker_args=CHUNKED, prefill_tp=2, decode_tp=2,
                           mem_fraction=(64 << 20) / host)
    outs, logs = run_cluster(config)
    assert [o.token_ids for o in outs] == expected
    for kind in ("prefill", "decode"):
        assert "1/2 of the host per rank" in logs[kind], logs[kind]
    # --tp-handoff auto between two sharded workers: each rank streams its own heads
    assert logs["prefill"].count("over per-rank streams (2 -> 2 ranks)") == len(PROMPTS)
    admitted = [line for line in logs["decode"].splitlines() if "admitted:" in line]
    assert [line.endswith("on per-rank streams") for line in admitted] == [True] * len(PROMPTS)


def test_up_passes_each_kind_its_tp():
    args = build_parser().parse_args(["up", "--prefill-tp", "2", "--decode-tp", "4"])
    config = cluster_config_from_args(args)
    assert (config.prefill_tp, config.decode_tp) == (2, 4)


@pytest.mark.parametrize("path", ["auto", "ranks", "leader"])
def test_up_passes_every_worker_its_tp_handoff(path):
    args = build_parser().parse_args(["up", "--prefill-tp", "2", "--tp-handoff", path])
    config = cluster_config_from_args(args)
    # worker_args go to every worker, prefill and decode alike
    assert config.worker_args == ("--tp-handoff", path)
    assert (config.prefill_args, config.decode_args) == ((), ())


def test_up_leaves_the_tp_handoff_to_the_workers_unless_given_and_refuses_another(capsys):
    config = cluster_config_from_args(build_parser().parse_args(["up"]))
    assert "--tp-handoff" not in config.worker_args
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["up", "--tp-handoff", "rank0"])
    assert exited.value.code == 2
    assert "invalid choice: 'rank0'" in capsys.readouterr().err


LONG_PROMPT = [(i * 37 + 11) % 256 for i in range(600)]  # 120 chunks of 5 tokens


def follower_pids(pid: int) -> list[int]:
    """The followers a TP worker ``pid`` spawned (not multiprocessing's resource tracker)."""
    import pathlib

    children = [int(c) for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    return [c for c in children
            if b"spawn_main" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]


def generate_in_background(cluster, prompt):
    """A thread running one generation (its result or its error in the returned list)."""
    import threading

    out: list = []

    def run():
        try:
            out.append(asyncio.run(generate_all(cluster.router_address, [prompt])))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_until(check, timeout_s: float) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def held(worker, cluster) -> bool:
    load = asyncio.run(worker_load(worker.address, worker.kind, cluster.internal_token))
    return load.free_pages < load.total_pages


@pytest.mark.parametrize("victim", ["prefill follower", "decode worker"])
def test_a_rank_that_dies_mid_stream_frees_the_other_side(victim):
    """A prefill follower killed while its handoff streams: the prefill group breaks, the
    handoff's call ends, and the decode worker gives back the room of every rank. A decode
    worker killed mid-stream: the prefill worker stops the prefill and frees its pages."""
    import os
    import signal

    config = ClusterConfig(model="tiny", worker_args=CHUNKED + ("--tp-handoff", "ranks"),
                           prefill_tp=2, decode_tp=2)
    with Cluster(config) as cluster:
        prefill, decode = ([w for w in cluster.workers if w.kind == kind][0]
                           for kind in ("prefill", "decode"))
        survivor, dying = (decode, prefill) if victim == "prefill follower" else (prefill, decode)
        thread, out = generate_in_background(cluster, LONG_PROMPT)
        assert wait_until(lambda: held(decode, cluster) and held(prefill, cluster), 30)
        pid = follower_pids(prefill.pid)[0] if victim == "prefill follower" else decode.pid
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not held(survivor, cluster), 30), survivor.stderr_tail(60)
        thread.join(60)
        assert out and isinstance(out[0], Exception), out
