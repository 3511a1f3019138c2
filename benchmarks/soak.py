"""Soak: minutes of mixed traffic against a `flashsplit up` cluster whose workers are killed.

Starts ``flashsplit up --model tiny --prefill-workers 2 --decode-workers 2 --draft tiny``
(the built-in random model, with ``--handoff-transport``), then for ``--duration`` seconds runs ``--clients`` concurrent clients sending the kinds
of ``benchmarks/soak_traffic.py`` (greedy with and without speculative decoding, a temperature
of 1e-300, sampled, cancelled mid-stream, short deadlines, hostile requests), while every
``--kill-every`` seconds one worker, chosen at random, gets SIGKILL and ``up`` restarts it.
Greedy outputs are compared with in-process generation (the oracle). At the end, once every
worker is back, it waits for the pools to drain and counts the pages and slots still held
(leaked: must be 0), checks greedy output once more, stops ``up`` with SIGTERM, prints a table
and writes everything as JSON. Exits 1 if anything went wrong.

    .venv/bin/python -m benchmarks.soak --duration 60 [--clients 4] [--out out/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from benchmarks.soak_traffic import EXPECTED, Outcome, Traffic, greedy, run_clients
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc

_WORKER = re.compile(r"^(?:restarted )?((?:prefill|decode)-\d+) on \S+ \(pid (\d+)\)$")
PAGE_SIZE, NUM_PAGES, NUM_SLOTS = 16, 512, 33


class Up:
    """``flashsplit up`` as a child: its output lines and the current pid of each worker."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "router.cli", "up", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lock = threading.Lock()
        self.lines: list[str] = []
        self.pids: dict[str, int] = {}
        self.router = ""
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            line = line.rstrip("\n")
            with self.lock:
                self.lines.append(line)
                m = _WORKER.match(line)
                if m:
                    self.pids[m.group(1)] = int(m.group(2))
                if line.startswith("router listening on "):
                    self.router = line.split()[-1]

    def count(self, prefix: str) -> int:
        with self.lock:
            return sum(line.startswith(prefix) for line in self.lines)

    def wait(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with self.lock:
                    tail = "\n".join(self.lines[-30:])
                raise SystemExit(f"soak: {what} did not happen within {timeout_s} s:\n{tail}")
            time.sleep(0.1)


def oracle(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt, generated in this process."""
    from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
    from common.model.load import load_model

    engine = LLMEngine(load_model("tiny"), EngineConfig(cache=CacheConfig(
        page_size=PAGE_SIZE, num_pages=NUM_PAGES, num_slots=NUM_SLOTS)))
    return [r.output_ids for r in engine.generate(prompts, greedy())]


def chaos(up: Up, until: float, every_s: float, rng: random.Random, log: list[dict]) -> None:
    """Kill a random worker every ``every_s`` seconds, one at a time (each is back before the
    next kill), until the clock passes ``until``."""
    next_kill = time.monotonic() + every_s
    while time.monotonic() + 1 < until:
        time.sleep(0.1)
        if time.monotonic() < next_kill:
            continue
        restarted = up.count("restarted ")
        with up.lock:
            name = rng.choice(sorted(up.pids))
            pid = up.pids[name]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        up.wait(lambda: up.count("restarted ") > restarted, 120, f"the restart of {name}")
        log.append({"worker": name, "pid": pid,
                    "back_after_s": round(time.monotonic() - killed_at, 2)})
        next_kill = killed_at + every_s


async def worker_table(address: str) -> list[generation_pb2.WorkerInfo]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await generation_pb2_grpc.GenerationStub(channel).ListWorkers(
            generation_pb2.ListWorkersRequest(), timeout=5)
    return list(reply.workers)


def leaks(address: str, timeout_s: float) -> dict:
    """Pages and slots still held once traffic stopped: waits for every worker to be healthy
    with all of it free, and reports what was still held when the wait ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = asyncio.run(worker_table(address))
        pages = sum(w.load.total_pages - w.load.free_pages for w in workers)
        slots = sum(w.load.total_slots - w.load.free_slots for w in workers)
        healthy = all(w.healthy and w.load.total_pages for w in workers)
        if (healthy and pages == 0 and slots == 0) or time.monotonic() > deadline:
            return {"pages": pages, "slots": slots, "all_healthy": healthy,
                    "workers": {w.address: {"free_pages": w.load.free_pages,
                                            "total_pages": w.load.total_pages,
                                            "free_slots": w.load.free_slots,
                                            "total_slots": w.load.total_slots}
                                for w in workers}}
        time.sleep(0.2)


async def traffic(address: str, prompts, expected, clients: int, seconds: float,
                  seed: int) -> list[Outcome]:
    async with grpc.aio.insecure_channel(address) as channel:
        t = Traffic(channel, prompts, expected, random.Random(seed))
        return await run_clients(t, clients, asyncio.get_running_loop().time() + seconds)


def summarize(outcomes: list[Outcome]) -> dict:
    rows = {}
    for kind in EXPECTED:
        mine = [o for o in outcomes if o.kind == kind]
        rows[kind] = {
            "sent": len(mine),
            "completed": sum(o.ending == "completed" for o in mine),
            "checked": sum(o.checked for o in mine),
            "mismatched": sum(o.checked and not o.matched for o in mine),
            "endings": dict(collections.Counter(o.ending for o in mine if o.ending != "completed")),
            "unexpected": sum(not o.expected for o in mine),
        }
    return rows


def print_table(report: dict) -> None:
    print(f"\nsoak: {report['duration_s']} s, {report['workers']}, {report['clients']} clients, "
          f"{len(report['kills'])} workers killed, {report['restarts']} restarts by up")
    print(f"{'kind':<17}{'sent':>6}{'completed':>11}{'checked':>9}{'mismatch':>10}"
          f"{'unexpected':>12}  failed by status")
    total = collections.Counter()
    for kind, row in report["kinds"].items():
        endings = ", ".join(f"{k} {v}" for k, v in sorted(row["endings"].items())) or "-"
        print(f"{kind:<17}{row['sent']:>6}{row['completed']:>11}{row['checked']:>9}"
              f"{row['mismatched']:>10}{row['unexpected']:>12}  {endings}")
        total.update({k: row[k] for k in ("sent", "completed", "checked", "mismatched",
                                          "unexpected")})
    print(f"{'total':<17}{total['sent']:>6}{total['completed']:>11}{total['checked']:>9}"
          f"{total['mismatched']:>10}{total['unexpected']:>12}")
    leak = report["leaked"]
    print(f"greedy outputs checked against the oracle: {total['checked']}, mismatched: "
          f"{total['mismatched']}; after the last restart: {report['final_greedy']}")
    print(f"pages leaked: {leak['pages']}, slots leaked: {leak['slots']} "
          f"(all workers healthy: {leak['all_healthy']}); up exited with {report['up_exit']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--kill-every", type=float, default=12.0, help="seconds between kills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--handoff-transport", default="auto",
                   help="the workers' --handoff-transport (auto, stream, tcp, device)")
    p.add_argument("--out", default="out/soak.json", help="where the JSON report goes")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(1, 40))] for _ in range(16)]
    expected = oracle(prompts)
    # the built-in random model its oracle runs (the default model is the trained one)
    up = Up(["--quiet", "--model", "tiny", "--prefill-workers", "2", "--decode-workers", "2",
             "--draft", "tiny", "--handoff-transport", args.handoff_transport,
             "--page-size", str(PAGE_SIZE), "--num-pages", str(NUM_PAGES), "--num-slots",
             str(NUM_SLOTS), "--grace", "2"])
    try:
        up.wait(lambda: up.router and len(up.pids) == 4, 300, "the cluster's start")
        start = time.monotonic()
        kills: list[dict] = []
        killer = threading.Thread(target=chaos, daemon=True, args=(
            up, start + args.duration, args.kill_every, random.Random(args.seed + 1), kills))
        killer.start()
        outcomes = asyncio.run(traffic(up.router, prompts, expected, args.clients,
                                       args.duration, args.seed))
        killer.join(timeout=150)
        leaked = leaks(up.router, timeout_s=60)
        outs = asyncio.run(_final_greedy(up.router, prompts, expected))
    finally:
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGTERM)
        try:
            up_exit = up.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.proc.kill()
            up_exit = up.proc.wait()
    report = {"duration_s": args.duration, "clients": args.clients,
              "workers": "2 prefill + 2 decode (tiny, draft tiny)", "kills": kills,
              "restarts": up.count("restarted "), "kinds": summarize(outcomes),
              "leaked": leaked, "final_greedy": outs, "up_exit": up_exit}
    print_table(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")
    failed = (any(r["unexpected"] for r in report["kinds"].values())
              or leaked["pages"] or leaked["slots"] or outs != "all match" or up_exit != 0)
    return 1 if failed else 0


async def _final_greedy(address: str, prompts, expected) -> str:
    """Every prompt once more, now that every worker is back: "all match" or what differed."""
    async with grpc.aio.insecure_channel(address) as channel:
        t = Traffic(channel, prompts, expected, random.Random(0))
        outcomes = [await t.check_greedy(i) for i in range(len(prompts))]
    bad = [o for o in outcomes if not o.matched]
    return "all match" if not bad else f"{len(bad)} of {len(outcomes)} differ"


if __name__ == "__main__":
    sys.exit(main())
