"""Time to first token: the same checkpoint in process and through router -> prefill -> decode.

Both sides run in this one run, on the same device, so the ratio is what disaggregation costs:

- TTFT of one prompt at each length (default 2k, 8k, 32k tokens), the median of ``--repeats``;
  in process it is one engine's prefill (``generate`` of one token), through the split it is
  the client's time to the first streamed token (on one channel kept open to the router);
- ``--concurrent`` prompts of ``--concurrent-len`` tokens generating ``--concurrent-new`` tokens
  each, at once: wall time and median TTFT, after an unmeasured run of the same shape (run E on an
  H200 timed 6.9 s in process without one, against 1.3 s in run D with one prompt per chunk:
  a first use of the batch shape is the suspected cost);
- each ``--transports`` value (``--handoff-transport`` of both workers) in a cluster of its own;
  the first token through the split is checked against the in-process one. The router streams
  the first token from the prefill worker as soon as it is sampled; an entry ending in ``/late``
  (``auto/late``, ``tcp:2/late``) runs a router that streams it from decode once the handoff is
  acknowledged, the baseline of that change. The client's time to the second token, which
  holds the handoff's tail when the first came early, is printed too. ``--concurrent 0`` leaves
  out the concurrent case. ``--mps`` runs it all under a CUDA MPS daemon of its own.

On a GPU the checkpoint is a Qwen3.5-4B-shaped model with random weights, written once to
``--workdir``; ``--model`` takes any checkpoint directory (or ``tiny`` on the CPU).

    python -m benchmarks.ttft --device cuda [--lengths 2048,8192,32768] [--out out/ttft.json]
    python -m benchmarks.ttft --model tiny --device cpu --lengths 64,256 --concurrent 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.phase_metrics import PHASES, PhaseScraper, read_histograms
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.load import load_model
from common.sampling import SamplingParams
from common.channels import make_channel
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb

PAGE_SIZE = 16
LATE = "/late"  # a --transports entry's suffix: the first token from decode (router_args)
# the decode worker's histogram of requests per engine step (its count: the steps)
DECODE_STEPS = "flashsplit_decode_step_requests"


def prompt_of(length: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, min(vocab, 200_000), (length,), generator=gen).tolist()


def random_checkpoint(workdir: Path) -> str:
    """A Qwen3.5-4B-shaped checkpoint with random weights (made once, then reused)."""
    from benchmarks.decode import build
    from benchmarks.shapes import QWEN3_5_4B
    from safetensors.torch import save_file

    path = workdir / "qwen3.5-4b-random"
    if (path / "model.safetensors").exists():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    model, _ = build("gpu", with_draft=False)
    (path / "config.json").write_text(json.dumps(dict(QWEN3_5_4B)))
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"))
    del model
    torch.cuda.empty_cache()
    return str(path)


def local_engine(args, num_slots: int) -> LLMEngine:
    """The in-process engine the benchmarks compare against: ``args.model`` on ``args.device``
    with its GPU kernels there, ``args.num_pages`` pages of ``PAGE_SIZE``, prefill chunks of
    ``args.max_prefill_tokens``, warmed up."""
    from common.model.kernels import select_kernels

    kernels = select_kernels("gpu" if args.device.startswith("cuda") else "reference")
    model = load_model(args.model, device=args.device, kernels=kernels)
    engine = LLMEngine(model, EngineConfig(
        device=args.device, cache=CacheConfig(page_size=PAGE_SIZE, num_pages=args.num_pages,
                                              num_slots=num_slots),
        scheduler=SchedulerConfig(max_prefill_tokens=args.max_prefill_tokens)))
    engine.warmup()
    return engine


def in_process(args, lengths: list[int]) -> dict:
    engine = local_engine(args, args.concurrent + 2)
    model = engine.model
    vocab = model.config.vocab_size
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    out = {"first_tokens": {}}
    for n in lengths:
        times = []
        for r in range(args.repeats + 1):  # the first run warms this shape up
            prompt = prompt_of(n, r, vocab)
            sync(args.device)
            start = time.perf_counter()
            (req,) = engine.generate([prompt], one)
            sync(args.device)
            times.append(time.perf_counter() - start)
        out[n] = statistics.median(times[1:])
        # the engine's first request after its warm-up: a kernel variant the warm-up left out
        # compiles here (seconds), which the median above would hide
        out.setdefault("first_request_s", times[0])
        out["first_tokens"][n] = req.output_ids[0]
        progress(f"in process, {n} tokens: TTFT {out[n] * 1e3:.1f} ms")
    if args.concurrent:
        concurrent_in_process(engine, args, vocab, out)
    del engine, model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def transport_args(spec: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(both workers' flags, the prefill worker's) of one ``--transports`` entry: a
    transport, or ``tcp:N`` for ``tcp`` with N connections per handoff; either may go on with
    ``+process`` or ``+thread`` (the prefill worker's ``--handoff-sender``) and end in
    ``/late`` (the router's flags: ``router_args``)."""
    base, _, sender = spec.removesuffix(LATE).partition("+")
    name, _, connections = base.partition(":")
    prefill: tuple[str, ...] = ("--handoff-sender", sender) if sender else ()
    if not connections:
        return ("--handoff-transport", name), prefill
    if name != "tcp" or not connections.isdigit():
        raise ValueError(f"{spec!r}: only tcp takes a connection count (tcp:N)")
    return ("--handoff-transport", name), ("--handoff-tcp-connections", connections, *prefill)


def router_args(spec: str) -> tuple[str, ...]:
    """The router's flags of one ``--transports`` entry: ``/late`` at its end streams the first
    token from decode once the handoff is acknowledged (the router's default streams it from
    the prefill worker as soon as it is sampled)."""
    return ("--first-token-after-handoff",) if spec.endswith(LATE) else ()


def disaggregated(args, lengths: list[int], vocab: int, transport: str) -> dict:
    both, prefill_only = transport_args(transport)
    worker_args = ("--device", args.device, "--page-size", str(PAGE_SIZE),
                   "--num-pages", str(args.num_pages), "--num-slots", str(args.concurrent + 2),
                   "--max-prefill-tokens", str(args.max_prefill_tokens), *both)
    config = ClusterConfig(model=args.model, worker_args=worker_args, prefill_args=prefill_only,
                           router_args=router_args(transport), start_timeout_s=900, metrics=True)
    out: dict = {"timings": {}, "first_tokens": {}, "second_token_s": {}}
    with Cluster(config) as cluster:
        phases = PhaseScraper([w.metrics_url for w in cluster.workers if w.metrics_url])
        progress(f"split with --handoff-transport {transport}: cluster up")
        asyncio.run(_measure_split(cluster.router_address, args, lengths, vocab, phases, out))
    return out


async def _measure_split(address: str, args, lengths: list[int], vocab: int,
                         phases: PhaseScraper, out: dict) -> None:
    """The split's cases, on one channel to the router (as a serving client keeps one)."""
    one = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    async with make_channel(address) as channel:
        async def ttft(prompt, params, seconds: list | None = None):
            """The client's time to the first token (to the second into ``seconds``)."""
            start = time.perf_counter()
            arrivals = []

            def seen(tokens):
                arrivals.extend(time.perf_counter() for _ in tokens)

            done = await generate(address, request_to_pb(token_ids=prompt, params=params),
                                  timeout_s=600, on_tokens=seen, channel=channel)
            end = time.perf_counter()
            if seconds is not None:
                seconds.append((arrivals[1] if len(arrivals) > 1 else end) - start)
            return (arrivals[0] if arrivals else end) - start, done

        for n in lengths:
            times, seconds, last = [], [], None
            cold, _ = await ttft(prompt_of(n, 0, vocab), one)  # warm-up, not in the median
            out.setdefault("first_request_s", cold)  # the cluster's first request
            phases.start()
            for r in range(1, args.repeats + 1):
                t, last = await ttft(prompt_of(n, r, vocab), one, seconds)
                times.append(t)
            out[n] = statistics.median(times)
            # the handoff's tail is in this one when the first token came early
            out["second_token_s"][n] = statistics.median(seconds)
            out["timings"][n] = {"client_ttft_s": times,
                                 "router_ttft_s": last.time_to_first_token_s,
                                 # from the Prefill call's arrival: the handoff's opening too
                                 "prefill_call_queue_s": last.prefill_queue_s,
                                 **phases.stop()}
            out["first_tokens"][n] = last.token_ids[0]
            phase_ms = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in out["timings"][n].items()
                                 if k != "client_ttft_s" and v is not None)
            progress(f"split, {n} tokens: TTFT {out[n] * 1e3:.1f} ms ({phase_ms})")

        async def concurrent(seed: int):
            prompts = [prompt_of(args.concurrent_len, seed + i, vocab)
                       for i in range(args.concurrent)]
            many = SamplingParams(temperature=0.0, max_new_tokens=args.concurrent_new,
                                  ignore_eos=True)
            start = time.perf_counter()
            results = await asyncio.gather(*[ttft(p, many) for p in prompts])
            return time.perf_counter() - start, [t for t, _ in results]

        if not args.concurrent:
            return
        await concurrent(200)  # warm-up of this batch shape, not measured
        before = read_histograms(phases.urls)
        out["concurrent_s"], ttfts = await concurrent(100)
        after = read_histograms(phases.urls)
        out["concurrent_median_ttft_s"] = statistics.median(ttfts)
        # the decode worker's steps: the first tokens came from prefill, in no step of its
        served, steps = (a - b for a, b in zip(after.get(DECODE_STEPS, (0, 0)),
                                               before.get(DECODE_STEPS, (0, 0))))
        out["concurrent_decode_steps"] = steps
        out["concurrent_mean_decode_batch"] = served / steps if steps else None
        progress(f"split, {args.concurrent} concurrent: {out['concurrent_s'] * 1e3:.1f} ms, "
                 f"{steps:.0f} decode steps")


def concurrent_in_process(engine, args, vocab: int, out: dict) -> None:
    """``args.concurrent`` prompts at once in ``engine``: wall time and steps into ``out``."""
    prompts = [prompt_of(args.concurrent_len, 100 + i, vocab) for i in range(args.concurrent)]
    many = SamplingParams(temperature=0.0, max_new_tokens=args.concurrent_new, ignore_eos=True)
    # a warm-up of this batch shape (kernels that compile per shape), not measured
    engine.generate([prompt_of(args.concurrent_len, 200 + i, vocab)
                     for i in range(args.concurrent)], many)
    sync(args.device)
    start = time.perf_counter()
    for prompt in prompts:  # generate(), counting the steps that gave tokens
        engine.add_request(prompt, many)
    steps = 0
    while engine.scheduler.num_requests:
        steps += bool(engine.step())
    sync(args.device)
    out["concurrent_s"] = time.perf_counter() - start
    out["concurrent_steps"] = steps
    progress(f"in process, {args.concurrent} concurrent: {out['concurrent_s'] * 1e3:.1f} ms, "
             f"{steps} steps")


def progress(line: str) -> None:
    """One measured case at once, on stderr: a run cut short by a time limit keeps them."""
    print(line, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint dir or 'tiny' (default: a random 4B-shaped one on CUDA)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--concurrent-len", type=int, default=2048)
    p.add_argument("--concurrent-new", type=int, default=128)
    p.add_argument("--num-pages", type=int, default=6144)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--transports", default="auto,stream",
                   help="--handoff-transport values to measure, each its own cluster; tcp:N "
                        "is tcp with N connections per handoff, +process or +thread the "
                        "prefill worker's --handoff-sender (e.g. stream+thread)")
    p.add_argument("--workdir", default="/tmp/flashsplit-bench")
    p.add_argument("--out", default="out/ttft.json")
    p.add_argument("--mps", action="store_true",
                   help="run everything (the in-process engine too) under a CUDA MPS daemon "
                        "of this run's own (common/mps.py), so the two workers' kernels "
                        "share the GPU instead of time-slicing it")
    args = p.parse_args(argv)
    if args.mps:
        import subprocess

        from common.mps import mps_daemon

        # the run is a child of its own, so that every MPS client (this process's engine too)
        # has exited when the daemon is told to quit: quit waits for its clients
        rest = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--mps"]
        with mps_daemon(Path(args.workdir)):
            return subprocess.call([sys.executable, "-m", "benchmarks.ttft", *rest])
    return measure(args)


def measure(args) -> int:
    """Run every case of ``args`` and print the tables."""
    if args.model is None:
        args.model = random_checkpoint(Path(args.workdir))
    lengths = [int(x) for x in args.lengths.split(",") if x]
    local = in_process(args, lengths)
    from common.model.registry import load_config
    vocab = load_config(args.model).vocab_size
    transports = [t for t in args.transports.split(",") if t]
    split = {t: disaggregated(args, lengths, vocab, t) for t in transports}
    rows = [(f"TTFT {n} tokens", n) for n in lengths]
    if args.concurrent:
        rows.append((f"{args.concurrent} x {args.concurrent_len} (+{args.concurrent_new}) wall",
                     "concurrent_s"))
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else "cpu", "model": args.model,
              "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
              "in_process": {str(k): v for k, v in local.items()},
              "disaggregated": {t: {str(k): v for k, v in r.items()} for t, r in split.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    width = max([11, *(len(t) for t in transports)])
    head = "".join(f" {t:>{width}} {'ratio':>6}" for t in transports)
    print(f"\n{'case':<34} {'in process':>11}{head}")
    for name, key in rows:
        a = local[key]
        cells = "".join(f" {split[t][key] * 1e3:>{width - 2}.1f}ms {split[t][key] / a:>6.2f}"
                        for t in transports)
        print(f"{name:<34} {a * 1e3:>9.1f}ms{cells}")
    # where the disaggregated time goes: the workers' own histograms, means over the repeats
    # the router's TTFT, the prefill worker's queue as it reports it (from the call's arrival,
    # so with the handoff's opening), then the workers' histograms
    columns = ["router_ttft_s", "prefill_call_queue_s", *(c for c, _ in PHASES)]
    print(f"\n{'phases (ms)':<22} {'client TTFT':>11}" + "".join(f" {c:>17}" for c in columns))
    for t in transports:
        for n in lengths:
            timing = split[t]["timings"][n]
            cells = "".join(f" {'-' if timing[c] is None else f'{timing[c] * 1e3:.1f}':>17}"
                            for c in columns)
            print(f"{t + ' ' + str(n):<22} {split[t][n] * 1e3:>11.1f}{cells}")
    print("\nclient's time to the second token (ms; the handoff's tail is in it when the first "
          "token came from prefill)")
    for t in transports:
        print(f"{t:<22} " + "  ".join(f"{n}: {split[t]['second_token_s'][n] * 1e3:.1f}"
                                      for n in lengths))
    firsts = ", ".join(f"{t} {split[t]['first_request_s'] * 1e3:.1f} ms" for t in transports)
    print(f"first request after start ({lengths[0]} tokens): in process "
          f"{local['first_request_s'] * 1e3:.1f} ms, {firsts}")
    for t in transports:
        same = split[t]["first_tokens"] == local["first_tokens"]
        if not args.concurrent:
            print(f"{t}: first tokens equal in process: {same}")
            continue
        print(f"{t}: first tokens equal in process: {same}; median TTFT of the "
              f"{args.concurrent} concurrent: {split[t]['concurrent_median_ttft_s'] * 1e3:.1f} ms"
              f"; their decode steps: {split[t]['concurrent_decode_steps']:.0f} "
              f"(in process: {local['concurrent_steps']} steps, prefill included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
