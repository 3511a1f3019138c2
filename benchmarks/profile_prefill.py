"""Where a long prompt's prefill spends its wall time when that is more than its device time.

One engine in this process (as ``benchmarks.ttft`` builds it) prefills one prompt under the
torch profiler, after a warm-up prompt of the same length. It prints:

- wall time, the union of the GPU's kernel and copy intervals (busy) and the idle rest;
- the host calls that wait for the device (stream / event / device synchronisations, copies to
  the host), with counts and time, and the Python lines that made torch synchronise during a
  prompt of its own (``torch.cuda.set_sync_debug_mode``: one entry per call site);
- the host operations with the most self time.

A wall time far above the busy time with few waits means the host launches too slowly; with
many waits, each one lets the GPU run dry while the host catches up.

    python -m benchmarks.profile_prefill --device cuda --length 32768 [--out out/prefill.json]
    python -m benchmarks.profile_prefill --model tiny --device cpu --length 512
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.ttft import local_engine, prompt_of, random_checkpoint, sync
from common.sampling import SamplingParams

# host calls that block until the device has done something
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpy", "aten::item", "aten::_local_scalar_dense")


def busy_ms(events) -> float:
    """The union of the device intervals (kernels and copies) in ``events``, in ms."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA)
    total, end = 0.0, None
    start = None
    for s, e in spans:
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start
    return total / 1e3


def own_frames(event, depth: int) -> str:
    """The innermost ``depth`` Python frames above ``event`` that are not torch's own (the
    profiler records Python calls as the events' parents)."""
    frames = []
    parent = event.cpu_parent
    while parent is not None and len(frames) < depth:
        name = parent.name
        if ".py(" in name and "torch/" not in name:
            frames.append(name.split("/")[-1] if "site-packages" not in name
                          else name.split("site-packages/")[-1])
        parent = parent.cpu_parent
    return " <- ".join(frames) or "(no Python frame)"


def sync_sites(engine, prompt, params, depth: int) -> list[tuple[str, int]]:
    """Python call sites (innermost ``depth`` frames outside torch) of every synchronising torch
    call during one ``generate`` of ``prompt``, with how often each ran."""
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "torch/" not in f.filename and "warnings.py" not in f.filename]
        where = " <- ".join(f"{f.filename.split('site-packages/')[-1].split('/work/')[-1]}:"
                            f"{f.lineno} {f.name}" for f in reversed(frames[-depth:]))
        sites[f"{str(message)[:60]} at {where}"] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            engine.generate([prompt], params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    return sites.most_common()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.profile_prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint dir or 'tiny' (default: a random 4B-shaped one on CUDA)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--num-pages", type=int, default=6144)
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--depth", type=int, default=4, help="Python frames shown per call site")
    p.add_argument("--workdir", default="/tmp/flashsplit-bench")
    p.add_argument("--out", default="out/profile_prefill.json")
    args = p.parse_args(argv)
    if args.model is None:
        args.model = random_checkpoint(Path(args.workdir))
    engine = local_engine(args, num_slots=4)
    vocab = engine.model.config.vocab_size
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    engine.generate([prompt_of(args.length, 0, vocab)], one)  # warm-up of this shape
    sync(args.device)
    start = time.perf_counter()
    engine.generate([prompt_of(args.length, 1, vocab)], one)
    sync(args.device)
    plain_ms = (time.perf_counter() - start) * 1e3
    activities = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, with_stack=True) as prof:
        start = time.perf_counter()
        engine.generate([prompt_of(args.length, 2, vocab)], one)
        sync(args.device)
        wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.events()
    busy = busy_ms(events)
    waits: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith(WAITS):
            where = f"{e.name} at {own_frames(e, args.depth)}"
            waits[where][0] += 1
            waits[where][1] += e.cpu_time_total / 1e3
    host = collections.Counter()
    calls = collections.Counter()
    for e in events:
        if e.device_type == DeviceType.CPU and ".py(" not in e.name:
            host[e.name] += e.self_cpu_time_total / 1e3
            calls[e.name] += 1
    sites = (sync_sites(engine, prompt_of(args.length, 3, vocab), one, args.depth)
             if args.device.startswith("cuda") else [])
    result = {"length": args.length, "wall_ms_unprofiled": plain_ms, "wall_ms": wall_ms,
              "device_busy_ms": busy,
              "waits": sorted(([k, n, t] for k, (n, t) in waits.items()),
                              key=lambda x: -x[2]),
              "sync_sites": sites,
              "host_self_ms": [[k, v, calls[k]] for k, v in host.most_common(25)]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\nhost self time (ms, calls):")
    for name, ms, n in result["host_self_ms"]:
        print(f"  {ms:9.1f} {n:7d}  {name[:100]}")
    print("\nwaits for the device (calls, ms):")
    for where, n, ms in result["waits"][:25]:
        print(f"  {n:5d} {ms:9.1f}  {where[:220]}")
    print("\nsynchronising torch calls, by call site (calls):")
    for where, n in sites[:30]:
        print(f"  {n:5d}  {where[:300]}")
    print(f"\n{'prompt':>7} {'wall ms':>9} {'profiled':>9} {'GPU busy':>9} {'idle':>7}")
    print(f"{args.length:>7} {plain_ms:>9.1f} {wall_ms:>9.1f} {busy:>9.1f} "
          f"{wall_ms - busy:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
