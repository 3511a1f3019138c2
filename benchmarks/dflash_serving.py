"""DFLASH through the split: output tokens/s with the draft against without, per concurrency.

One cluster (router -> prefill -> decode, real processes) serves the target with ``--draft``;
`flashsplit bench`'s runner drives it over gRPC at each ``--concurrency``, the same requests
twice in a row: with speculation off, then on (``speculative`` is each request's own choice, so
both halves run on the same processes and device, seconds apart). Prompts are evenly spaced
windows of ``--prompt-tokens`` tokens of held-out text (the corpus's ``eval.jsonl``), sent as
text; each asks for exactly ``--output-len`` tokens, greedy by default. τ (tokens per DFLASH
step) is read from the decode worker's ``spec_accept_length`` histogram around each run.
Before each concurrency's runs, one unmeasured wave of that many short requests goes each way,
so that a batch size's first use (which may compile a kernel variant) is in neither.

    python -m benchmarks.dflash_serving --model pycoder --draft pycoder \\
        --data CORPUS/eval.jsonl [--concurrency 1,8,32] [--device cuda] [--mps] \\
        [--out out/x.json]

Prints the table last (throughput and its ratio, the decode steps' ratio from the TPOT medians
(``decode x``: without each request's wait for its first token), τ, the TPOT medians, the
decode worker's mean engine step (``flashsplit_decode_step_time_seconds``: against the TPOT,
the engine's part of a token's time), and the TTFT medians each way); ``--out`` gets every
figure. ``--mps`` runs both workers under a CUDA MPS
daemon of the run's own: on one GPU the two processes' kernels otherwise take turns on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.phase_metrics import read_histograms
from router.bench.config import BenchConfig, LengthDist, Load
from router.bench.runner import run_bench
from router.cluster import Cluster, ClusterConfig

ACCEPT_LENGTH = "flashsplit_decode_spec_accept_length"
STEP_TIME = "flashsplit_decode_step_time_seconds"
# output tokens of each warm-up request (a wave of as many as are in flight, each way)
WARM_UP_TOKENS = 16


@dataclass(frozen=True)
class ServingConfig:
    model: str
    draft: str
    data: str
    concurrency: tuple[int, ...] = (1, 8, 32)
    prompts_per_slot: int = 2  # requests per point: this many per request in flight
    # ...and at least this many: at 1 in flight, 2 requests gave τ 8.95 where 32 held-out
    # prompts averaged 4.15 (H100, 2026-12-06), so a small point's speedup was its prompts'
    min_requests: int = 16
    prompt_tokens: int = 128
    output_len: int = 128
    temperature: float = 0.0
    device: str = "cpu"
    worker_args: tuple[str, ...] = ()
    # both workers as clients of a CUDA MPS daemon of the cluster's own: on one GPU their
    # kernels then run side by side instead of taking turns (router/cluster.py)
    mps: bool = False
    # an unmeasured wave of each concurrency's size, each way, before its runs
    warm_up_wave: bool = True


def prompt_texts(config: ServingConfig, count: int) -> list[str]:
    """``count`` evenly spaced windows of the held-out data, as text."""
    from common.model.load import eos_token_ids_for
    from common.model.registry import load_config
    from common.tokenizer import load_tokenizer
    from common.training.token_data import held_out_windows

    tokenizer = load_tokenizer(config.model)
    eos = eos_token_ids_for(config.model, load_config(config.model))
    windows = held_out_windows(config.data, tokenizer, eos[0] if eos else None,
                               config.prompt_tokens, count)
    return [tokenizer.decode(w) for w in windows]


def requests_at(config: ServingConfig, concurrency: int) -> int:
    """Measured requests of each arm at ``concurrency`` in flight."""
    return max(config.prompts_per_slot * concurrency, config.min_requests)


def mean_between(before: dict, after: dict, family: str) -> float | None:
    """The mean of histogram ``family``'s observations between two ``read_histograms``."""
    (s0, n0), (s1, n1) = before.get(family, (0.0, 0.0)), after.get(family, (0.0, 0.0))
    return (s1 - s0) / (n1 - n0) if n1 > n0 else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def run(config: ServingConfig, *, progress=print) -> list[dict]:
    """One row per concurrency: plain and DFLASH throughput, their ratio, and τ."""
    count = max(requests_at(config, c) for c in config.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": t}) + "\n"
                                   for t in prompt_texts(config, count)))
        worker_args = ("--device", config.device, "--draft", config.draft, *config.worker_args)
        with Cluster(ClusterConfig(model=config.model, worker_args=worker_args, metrics=True,
                                   start_timeout_s=900, mps=config.mps)) as cluster:
            decode_metrics = [w.metrics_url for w in cluster.workers if w.kind == "decode"]
            rows = []
            for c in config.concurrency:
                row: dict = {"concurrency": c, "requests": requests_at(config, c)}

                def bench(speculative: bool, requests: int, output_len: int) -> BenchConfig:
                    return BenchConfig(
                        backend="grpc", url=cluster.router_address, loads=(Load(concurrency=c),),
                        num_prompts=requests, prompts_file=str(prompts),
                        output_len=LengthDist(output_len, output_len),
                        temperature=config.temperature, speculative=speculative, warmup=0,
                        json_path=None, plot_path=None, progress=False)

                # one unmeasured wave of c requests each way first: a batch size's first use
                # may compile a kernel variant (seconds), which would land in one arm only
                for speculative in (False, True) if config.warm_up_wave else ():
                    asyncio.run(run_bench(bench(speculative, c, WARM_UP_TOKENS)))
                for name, speculative in (("plain", False), ("dflash", True)):
                    before = read_histograms(decode_metrics)
                    (point,) = asyncio.run(run_bench(bench(speculative, row["requests"],
                                                           config.output_len))).points
                    after = read_histograms(decode_metrics)
                    s = point.summary
                    if s.failed:
                        raise RuntimeError(f"{s.failed} {name} requests failed at "
                                           f"concurrency {c}")
                    row[name] = {"output_tokens_per_s": s.output_throughput,
                                 "tpot_p50_ms": s.tpot.p50, "ttft_p50_ms": s.ttft.p50,
                                 "output_tokens": s.output_tokens,
                                 "tau": mean_between(before, after, ACCEPT_LENGTH),
                                 "step_ms": _ms(mean_between(before, after, STEP_TIME))}
                    progress(f"concurrency {c}, {name}: {s.output_throughput:.1f} output "
                             f"tokens/s, TPOT p50 {s.tpot.p50:.2f} ms, decode worker's "
                             f"step {row[name]['step_ms'] or 0:.2f} ms")
                row["speedup"] = (row["dflash"]["output_tokens_per_s"]
                                  / row["plain"]["output_tokens_per_s"])
                # decode alone: each request's time per token after its first, whose wait
                # (the prompt's prefill and handoff) the throughput above counts too
                row["decode_speedup"] = (row["plain"]["tpot_p50_ms"]
                                         / row["dflash"]["tpot_p50_ms"])
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'concurrency':>11} {'plain tok/s':>12} {'DFLASH tok/s':>13} {'speedup':>8} "
             f"{'decode x':>8} {'tau':>5} {'TPOT plain ms':>14} {'TPOT DFLASH ms':>15} "
             f"{'step plain ms':>14} {'step DFLASH ms':>15} "
             f"{'TTFT plain ms':>14} {'TTFT DFLASH ms':>15}"]

    def num(value: float | None, width: int, digits: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

    for r in rows:
        p, d = r["plain"], r["dflash"]
        lines.append(f"{r['concurrency']:>11} {p['output_tokens_per_s']:>12.1f} "
                     f"{d['output_tokens_per_s']:>13.1f} {r['speedup']:>8.2f} "
                     f"{r['decode_speedup']:>8.2f} {num(d['tau'], 5, 2)} "
                     f"{p['tpot_p50_ms']:>14.2f} {d['tpot_p50_ms']:>15.2f} "
                     f"{num(p.get('step_ms'), 14, 2)} {num(d.get('step_ms'), 15, 2)} "
                     f"{p['ttft_p50_ms']:>14.1f} {d['ttft_p50_ms']:>15.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dflash_serving",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="target directory or built-in name")
    p.add_argument("--draft", required=True, help="draft directory or built-in name")
    p.add_argument("--data", required=True, help="held-out text (e.g. CORPUS/eval.jsonl)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompts-per-slot", type=int, default=ServingConfig.prompts_per_slot,
                   help="requests per load point, per request in flight")
    p.add_argument("--min-requests", type=int, default=ServingConfig.min_requests,
                   help="at least this many requests per load point (a point of few requests "
                        "measures those prompts' accept length, not the data's)")
    p.add_argument("--prompt-tokens", type=int, default=ServingConfig.prompt_tokens)
    p.add_argument("--output-len", type=int, default=ServingConfig.output_len)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="one more worker flag (repeat it: --worker-arg=--kernels "
                        "--worker-arg=gpu)")
    p.add_argument("--no-warm-up-wave", action="store_true",
                   help="measure without the unmeasured wave before each concurrency (a first "
                        "burst's cost, e.g. kernels that compile on first use, shows)")
    p.add_argument("--mps", action="store_true",
                   help="run both workers under a CUDA MPS daemon of the run's own (one GPU)")
    p.add_argument("--out", default="out/dflash_serving.json")
    args = p.parse_args(argv)
    config = ServingConfig(
        model=args.model, draft=args.draft, data=args.data,
        concurrency=tuple(int(c) for c in args.concurrency.split(",") if c),
        prompts_per_slot=args.prompts_per_slot, min_requests=args.min_requests,
        prompt_tokens=args.prompt_tokens,
        output_len=args.output_len, temperature=args.temperature, device=args.device,
        worker_args=tuple(args.worker_arg), mps=args.mps,
        warm_up_wave=not args.no_warm_up_wave)
    rows = run(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "config": vars(args),
                               "rows": rows}, indent=2) + "\n")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
