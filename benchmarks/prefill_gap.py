"""Why a prefill worker's prefill can take longer than the same engine's in process.

Each case prefills the same prompts on the same device, one after the other in this process,
so the ratios are what each difference between the worker and a plain engine costs:

- ``engine``: an ``LLMEngine`` built as ``benchmarks.ttft`` builds it (``generate`` of one token);
- ``worker-main``: the engine as the prefill worker builds it (``worker_engine`` from the
  worker's flags, ``hold_after_prefill``), stepped on the main thread;
- ``worker``: the same engine stepped by a ``PrefillEngine`` thread, as in the worker, whose
  sink takes every report (the per-layer events are recorded);
- ``worker+shared``: the same with its pools moved into shareable memory (``SharedPools``), as a
  worker with ``--handoff-transport auto`` or ``device`` does;
- ``engine+idle peer``: ``engine`` again while an idle decode worker process holds its own
  context and pools on the same device.

Each case runs in a process of its own. Each also reports the device time of its kernels (a profiler trace of one prompt), so a
slower wall time with the same device time is the host's, and a slower device time is the GPU's.

    python -m benchmarks.prefill_gap --device cuda --lengths 8192,32768 [--out out/gap.json]
    python -m benchmarks.prefill_gap --model tiny --device cpu --lengths 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.ttft import PAGE_SIZE, local_engine, prompt_of, random_checkpoint, sync
from common.sampling import SamplingParams


def worker_args(args, transport: str) -> argparse.Namespace:
    from prefill_service.__main__ import build_parser

    return build_parser().parse_args([
        "--model", args.model, "--device", args.device, "--page-size", str(PAGE_SIZE),
        "--num-pages", str(args.num_pages), "--num-slots", "4",
        "--max-prefill-tokens", str(args.max_prefill_tokens), "--handoff-transport", transport,
        "--no-progress"])


def engine_case(args):
    engine = local_engine(args, num_slots=4)
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)

    def prefill(prompt):
        engine.generate([prompt], one)

    return prefill, lambda: None, engine.model.config.vocab_size


def worker_main_case(args):
    from common.worker_args import worker_engine

    with worker_engine(worker_args(args, "stream"), prefill=True) as (_, built):
        engine = built.engine
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)

    def prefill(prompt):
        engine.add_request(list(prompt), one, request_id="gap")
        while engine.has_work():
            engine.step()
        engine.release("gap")

    return prefill, lambda: None, engine.model.config.vocab_size


def worker_case(args, shared: bool):
    from common.request_spec import RequestSpec
    from common.worker_args import worker_engine
    from prefill_service.engine import PrefillEngine, PrefillJob
    from prefill_service.shared_pools import SharedPools

    # as the worker builds it (on the CPU its main thread keeps one torch thread)
    with worker_engine(worker_args(args, "auto" if shared else "stream"),
                       prefill=True) as (_, built):
        pass
    pools = SharedPools(built.engine) if shared else None
    engine = PrefillEngine(built.engine, built.layout, built.fingerprint)
    engine.start()
    reports = []
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    ids = iter(range(1, 1 << 30))

    def prefill(prompt):
        hid = next(ids)
        engine.submit(PrefillJob(hid, RequestSpec(f"gap-{hid}", tuple(prompt), one)), reports.append).result()
        engine.release(hid).result()

    def close():
        engine.stop()
        if pools is not None:
            pools.close()

    return prefill, close, built.engine.model.config.vocab_size


def idle_peer(args) -> subprocess.Popen:
    """A decode worker that loads and then waits, on the same device."""
    cmd = [sys.executable, "-m", "decode_service", "--model", args.model, "--device",
           args.device, "--page-size", str(PAGE_SIZE), "--num-pages", str(args.num_pages),
           "--num-slots", "4", "--no-progress", "--port", "0", "--insecure-no-auth"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 900
    for line in proc.stdout:
        if "listening on" in line:
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("the idle decode worker did not start")


def device_ms(prefill, prompt, device: str) -> float:
    """Kernel time of one prefill of ``prompt`` (ms), from a profiler trace."""
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        prefill(prompt)
        sync(device)
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or 0
        if t > 0 and e.key and not e.key.startswith(("cuda", "aten::")):
            total += t
    return total / 1e3


def measure(name, build, args, lengths) -> dict:
    prefill, close, vocab = build()
    out = {}
    try:
        for n in lengths:
            times = []
            for r in range(args.repeats + 1):  # the first warms the shape up
                prompt = prompt_of(n, r, vocab)
                sync(args.device)
                start = time.perf_counter()
                prefill(prompt)
                sync(args.device)
                times.append(time.perf_counter() - start)
            out[n] = {"wall_ms": statistics.median(times[1:]) * 1e3,
                      "device_ms": device_ms(prefill, prompt_of(n, 99, vocab), args.device)}
            print(f"{name} {n}: {out[n]}", file=sys.stderr, flush=True)
    finally:
        close()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


CASES = {"engine": engine_case, "worker-main": worker_main_case,
         "worker": lambda args: worker_case(args, shared=False),
         "worker+shared": lambda args: worker_case(args, shared=True),
         "engine+idle peer": engine_case}
RESULT = "prefill_gap result: "


def run_case(case: str, argv: list[str], args) -> dict:
    """One case in a child process (with the idle peer beside it when the case asks)."""
    peer = idle_peer(args) if case.endswith("idle peer") else None
    try:
        child = subprocess.run([sys.executable, "-m", "benchmarks.prefill_gap", *argv,
                                "--model", args.model, "--one-case", case],
                               stdout=subprocess.PIPE, text=True, check=True)
    finally:
        if peer is not None:
            peer.kill()
            peer.wait()
    line = next(x for x in child.stdout.splitlines() if x.startswith(RESULT))
    return {int(k): v for k, v in json.loads(line[len(RESULT):]).items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.prefill_gap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint dir or 'tiny' (default: a random 4B-shaped one on CUDA)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-pages", type=int, default=6144)
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--one-case", default=None, help=argparse.SUPPRESS)  # the child's
    p.add_argument("--workdir", default="/tmp/flashsplit-bench")
    p.add_argument("--out", default="out/prefill_gap.json")
    args = p.parse_args(argv)
    if args.model is None:
        args.model = random_checkpoint(Path(args.workdir))
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.one_case is not None:
        print(RESULT + json.dumps(measure(args.one_case, lambda: CASES[args.one_case](args),
                                          args, lengths)), flush=True)
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; known: {sorted(CASES)}")
    results = {case: run_case(case, argv if argv is not None else sys.argv[1:], args)
               for case in cases}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "device": args.device,
                                          "results": results}, indent=1))
    base = results.get(cases[0], {})
    print(f"\n{'case':<18} {'prompt':>7} {'wall ms':>9} {'device ms':>10} {'wall ×':>7}")
    for case, per in results.items():
        for n, r in per.items():
            ratio = r["wall_ms"] / base[n]["wall_ms"] if n in base else float("nan")
            print(f"{case:<18} {n:>7} {r['wall_ms']:>9.1f} {r['device_ms']:>10.1f} "
                  f"{ratio:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
