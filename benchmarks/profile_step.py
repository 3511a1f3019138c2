"""Where the time of one decode step and one DFLASH step goes (engine with CUDA graphs).

- decode: a profiler trace of a few graphed decode steps. It prints the kernels with the most GPU
  time and their launch counts per step, and the step's device time against its wall time (the
  host's share).
- host: the Python functions a step (DFLASH's, else decode's) spends its host time in, under
  cProfile (time of their own and cumulative, per step).
- dflash: each phase of a DFLASH step timed with a device synchronisation around it: draft
  proposal, verify forward, acceptance, GDN commit, draft-context extension, and the rest (host
  bookkeeping). The synchronisations serialise the step, so the phases add up to more than
  an unprofiled step. With the greedy commit graphs (``--no-commit-graphs`` turns them off)
  acceptance and commit are one replay, timed as "commit". With verify graphs the draft
  context is written inside the verify forward and is part of "verify"; uncaptured (the CPU,
  or a batch above the graphs' sizes) the verify is the target's eager forward, and the
  context's extension after it is timed as "context".

    python -m benchmarks.profile_step --device cuda --batch 1 [--out out/profile.json]
    python -m benchmarks.profile_step --model qwen3.5-35b-a3b          # MoE decode (no DFLASH)
    python -m benchmarks.profile_step --device cpu --model tiny      # a quick run on the CPU
    python -m benchmarks.profile_step --model pycoder --draft pycoder  # a trained pair
    python -m benchmarks.profile_step --model pycoder-large            # its larger pair's shape
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode import add_dflash_step_flags, build, engine_for, fill_batch
from benchmarks.shapes import DRAFTS, SHAPES
from common.engine import speculative
from common.engine.cuda_graph import CudaGraphConfig
from common.engine.factory import choose_kernel_set
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.dflash import load_draft
from common.model.kernels import select_kernels
from common.model.load import load_model
from common.ops.gpu_backends import AUTO

PHASES = ("propose", "verify", "accept", "commit", "context")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def tiny_engine(draft: bool) -> LLMEngine:
    model = load_model("tiny")
    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=600, num_slots=20),
                          scheduler=SchedulerConfig(max_running_requests=16),
                          cuda_graph=CudaGraphConfig(capture=False))
    return LLMEngine(model, config, draft=load_draft("tiny", model) if draft else None)


def load_pair(model_name: str, draft_name: str, kernels: str, device: str):
    """A checkpoint (a built-in name or a directory) and its draft (None without one), with
    kernel set ``kernels`` (a set that runs on ``device``)."""
    model = load_model(model_name, device=device, kernels=select_kernels(kernels))
    return model.eval(), load_draft(draft_name, model) if draft_name else None


def profile_decode(engine: LLMEngine, device: str, steps: int = 5, wall_steps: int = 30) -> dict:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.startswith("cuda") else [])
    engine.step()
    _sync(device)
    # wall time from unprofiled steps: starting the profiler alone takes longer than a step
    start = time.perf_counter()
    for _ in range(wall_steps):
        engine.step()
    _sync(device)
    wall = (time.perf_counter() - start) / wall_steps
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(device)
    kernels = collections.Counter()
    counts = collections.Counter()
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or 0
        if t > 0 and e.key and not e.key.startswith(("cuda", "aten::", "Memcpy")):
            kernels[e.key] += t / steps
            counts[e.key] += e.count / steps
    device_us = sum(kernels.values())
    top = [{"kernel": k[:120], "us_per_step": v, "launches_per_step": counts[k]}
           for k, v in kernels.most_common(40)]
    gemm_us = sum(v for k, v in kernels.items() if _is_gemm(k))
    host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    top_host = [{"op": e.key[:90], "self_us_per_step": e.self_cpu_time_total / steps,
                 "calls_per_step": e.count / steps} for e in host[:15]]
    return {"wall_ms": wall * 1e3, "device_ms": device_us / 1e3, "gemm_ms": gemm_us / 1e3,
            "launches_per_step": sum(counts.values()), "top": top, "top_host": top_host}


def _is_gemm(kernel: str) -> bool:
    """cuBLAS/cuBLASLt kernel names (sm90_xmma, nvjet, cutlass, gemv)."""
    return any(s in kernel.lower() for s in ("gemm", "gemv", "xmma", "nvjet", "cutlass"))


def host_functions(engine: LLMEngine, device: str, steps: int = 50, top: int = 25) -> list[dict]:
    """The Python functions a step spends its host time in: up to ``steps`` unsynchronised
    steps under cProfile (fewer if the engine's requests end first: a step with nothing to run
    is not a step's cost), the functions with the most time of their own (per step), each
    with its cumulative time. cProfile slows every call alike, so the shares are what to read."""
    engine.step()
    _sync(device)
    prof = cProfile.Profile()
    ran = 0
    prof.enable()
    while ran < steps and engine.has_work():
        engine.step()
        ran += 1
    _sync(device)
    prof.disable()
    if ran == 0:
        raise RuntimeError("the engine had no requests left to profile")
    steps = ran
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, prim, own, cum, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": v[1] / steps,
             "own_us_per_step": v[2] / steps * 1e6, "cum_us_per_step": v[3] / steps * 1e6}
            for (f, line, name), v in rows]


def time_dflash_phases(engine: LLMEngine, device: str, steps: int = 20, warm: int = 3) -> dict:
    """Wrap each phase of ``DFlashSpeculator.step`` with a synchronised timer; medians over
    ``steps`` steps after ``warm`` untimed ones (the first steps of a new accepted length may
    compile kernels)."""
    spec, target = engine.speculator, engine.speculator.target
    current = collections.defaultdict(float)
    running: list[str] = []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            if running:
                # called inside another timed phase (an uncaptured verify "graph" runs the
                # target's forward): that phase's time already holds it
                return fn(*args, **kwargs)
            running.append(name)
            try:
                _sync(device)
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                _sync(device)
                current[name] += time.perf_counter() - t
            finally:
                running.pop()
            return out
        return wrapper

    # greedy batches accept on the device (greedy_match), others on the host (_accept)
    originals = {"propose": spec.propose, "accept": spec._accept,
                 "greedy_match": speculative.greedy_match,
                 "commit": target.commit_verified, "context": spec.extend_context}
    spec.propose = timed("propose", spec.propose)
    spec._accept = timed("accept", spec._accept)
    speculative.greedy_match = timed("accept", speculative.greedy_match)
    target.commit_verified = timed("commit", target.commit_verified)
    spec.extend_context = timed("context", spec.extend_context)
    verify, commit_graphs = spec.verify_graphs, spec.commit_graphs
    if verify is not None:
        originals["verify"] = verify.run
        verify.run = timed("verify", verify.run)
    # the eager verify (no graph serves the batch): the target's forward, or the
    # tensor-parallel runner's; a step whose requests all speculate runs no other forward
    eager = spec.runner if spec.runner is not None else target
    eager.forward = timed("verify", eager.forward)
    if commit_graphs is not None:  # acceptance and commit in one replay: timed as "commit"
        originals["commit_graphs"] = commit_graphs.run
        commit_graphs.run = timed("commit", commit_graphs.run)
    rows = []
    try:
        for i in range(warm + steps):
            current.clear()
            _sync(device)
            start = time.perf_counter()
            engine.step()
            _sync(device)
            wall = time.perf_counter() - start
            if i >= warm:
                row = {name: current[name] * 1e3 for name in PHASES}
                row["rest"] = wall * 1e3 - sum(row.values())
                row["step"] = wall * 1e3
                rows.append(row)
    finally:
        spec.propose, spec._accept = originals["propose"], originals["accept"]
        speculative.greedy_match = originals["greedy_match"]
        target.commit_verified, spec.extend_context = originals["commit"], originals["context"]
        if verify is not None:
            verify.run = originals["verify"]
        del eager.forward  # the instance attribute set above; the class's method again
        if commit_graphs is not None:
            commit_graphs.run = originals["commit_graphs"]
    return {name: statistics.median(r[name] for r in rows) for name in rows[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="qwen3.5-4b",
                   help="a benchmarks/shapes.py name (random weights; DFLASH for those with a "
                        "draft in its DRAFTS: qwen3.5-4b, pycoder-large), tiny, or a checkpoint (a built-in name "
                        "such as pycoder, or a directory) with --draft")
    p.add_argument("--draft", default="",
                   help="the DFLASH draft of a checkpoint --model (a built-in name or a "
                        "directory); without it only the decode step is profiled")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kernels", default=AUTO,
                   help="a kernel set (e.g. gpu-no-pdl, reference; default: the workers' "
                        "choice for --device and for an engine with or without a draft)")
    p.add_argument("--out", default="out/profile.json")
    add_dflash_step_flags(p)
    args = p.parse_args(argv)
    with_draft = bool(args.draft) or args.model in DRAFTS
    kernels = choose_kernel_set(args.kernels, args.device, speculative_decode=with_draft)[0]
    if args.model == "tiny":
        plain, spec = tiny_engine(False), tiny_engine(True)
        prompt_len, vocab = 24, 250
    else:
        if args.model in SHAPES:
            model, draft = build(kernels, with_draft=args.model in DRAFTS, shape=args.model)
            prompt_len, vocab = 512, model.config.vocab_size
        else:
            model, draft = load_pair(args.model, args.draft, kernels, args.device)
            prompt_len, vocab = 128, model.config.vocab_size
        graphs, running = args.device.startswith("cuda"), max(8, args.batch)
        plain = engine_for(model, None, max_running=running, graphs=graphs, device=args.device)
        spec = None if draft is None else engine_for(
            model, draft, block_size=args.block_size, max_running=running, graphs=graphs,
            device=args.device, commit_graphs=args.commit_graphs, draft_ahead=args.draft_ahead,
            verify_ahead=args.verify_ahead)
    def fresh_batch(engine: LLMEngine) -> LLMEngine:
        """``engine`` with a new batch of prompts, prefilled: a trained draft can end a batch
        within one measurement's steps, and a step with nothing to run costs nothing."""
        for request_id in list(engine.requests):
            engine.abort(request_id)
        fill_batch(engine, args.batch, prompt_len, 400, vocab=vocab)
        return engine

    decode = profile_decode(fresh_batch(plain), args.device)
    dflash = time_dflash_phases(fresh_batch(spec), args.device) if spec else {}
    dflash_profile = profile_decode(fresh_batch(spec), args.device) if spec else {}
    host = host_functions(fresh_batch(spec if spec else plain), args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "batch": args.batch, "decode": decode,
                               "dflash": dflash, "dflash_profile": dflash_profile,
                               "host_functions": host}, indent=2))
    print(f"decode step: wall {decode['wall_ms']:.2f} ms, device {decode['device_ms']:.2f} ms "
          f"(GEMMs {decode['gemm_ms']:.2f} ms), {decode['launches_per_step']:.0f} launches")
    for k in decode["top"][:25]:
        print(f"  {k['us_per_step']:>9.1f} us  x{k['launches_per_step']:<5.0f} {k['kernel']}")
    if not spec:
        _print_host(host, "decode")
        return 0
    print(f"dflash step: wall {dflash_profile['wall_ms']:.2f} ms, device "
          f"{dflash_profile['device_ms']:.2f} ms, {dflash_profile['launches_per_step']:.0f} launches")
    for k in dflash_profile["top"][:12]:
        print(f"  {k['us_per_step']:>9.1f} us  x{k['launches_per_step']:<5.0f} {k['kernel']}")
    for k in dflash_profile["top_host"][:12]:
        print(f"  host {k['self_us_per_step']:>9.1f} us  x{k['calls_per_step']:<5.0f} {k['op']}")
    _print_host(host, "dflash")
    print("dflash step, medians (ms): " + "  ".join(f"{k} {v:.2f}" for k, v in dflash.items()))
    return 0


def _print_host(host: list[dict], step: str) -> None:
    print(f"{step} step's host time by function under cProfile (us per step, own / cumulative):")
    for h in host:
        print(f"  {h['own_us_per_step']:>8.1f} {h['cum_us_per_step']:>8.1f}  "
              f"x{h['calls_per_step']:<6.1f} {h['function'][:100]}")


if __name__ == "__main__":
    raise SystemExit(main())
