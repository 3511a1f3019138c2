"""``flashsplit bench``: its flags, and the run that prints the table last.

Progress bars go to stderr; the table goes to stdout after every load point has run, so
``flashsplit bench ... > table.md`` keeps just the table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from common.cli_help import HelpFormatter
from common.security import API_KEY_ENV, add_client_args
from common.tls import TlsFiles
from router.bench.config import BenchConfig, LengthDist, parse_loads


def add_bench_parser(sub) -> None:
    """The ``bench`` subcommand, on the ``flashsplit`` command's subparsers."""
    b = sub.add_parser(
        "bench", help="serving benchmark against a router (gRPC) or any OpenAI-compatible "
                      "server",
        description="Drive a router (gRPC) or any OpenAI-compatible server at fixed "
                    "concurrencies or Poisson request rates; print latency percentiles and "
                    "throughput per load point, write JSON and a plot (docs/bench.md).",
        formatter_class=HelpFormatter)
    b.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="which API to drive")
    b.add_argument("--url", required=True,
                   help="grpc: the router's host:port; openai: the server's base URL "
                        "(http://host:port, /v1 added when missing)")
    b.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="openai: /v1/completions or /v1/chat/completions")
    b.add_argument("--model", default=None,
                   help="openai: the model field (default: the first model the server "
                        "lists)")
    load = b.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None,
                      help="comma-separated requests in flight, one load point each "
                           "(default: 1)")
    load.add_argument("--request-rate", default=None,
                      help="comma-separated Poisson arrival rates in requests/s, 'inf' for "
                           "all at once")
    b.add_argument("--max-concurrency", type=int, default=None,
                   help="with --request-rate: at most this many requests in flight "
                        "(default: no limit)")
    b.add_argument("--num-prompts", type=int, default=32, help="requests per load point")
    b.add_argument("--input-len", default="32",
                   help="prompt tokens: N, or LOW:HIGH for uniform (random token ids; chat: "
                        "random words)")
    b.add_argument("--output-len", default="32", help="tokens to generate: N or LOW:HIGH")
    b.add_argument("--prompts-file", default=None,
                   help="prompts instead of random ones: one per line, or JSON lines with "
                        "a \"prompt\" field")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    b.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    b.add_argument("--top-k", type=int, default=0, help="0 = off")
    b.add_argument("--seed", type=int, default=0,
                   help="seeds the workload, and request i samples with seed + i")
    b.add_argument("--respect-eos", action="store_true",
                   help="let requests end at an end-of-sequence token (otherwise each "
                        "generates exactly its --output-len tokens)")
    b.add_argument("--speculative", choices=("auto", "on", "off"), default="auto",
                   help="DFLASH per request (auto: the decode worker decides)")
    b.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    b.add_argument("--json", dest="json_path", default="bench.json", metavar="PATH",
                   help="where to write the JSON report ('' = nowhere)")
    b.add_argument("--plot", dest="plot_path", default="bench.png", metavar="PATH",
                   help="where to draw the latency-against-load PNG ('' = nowhere)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_client_args(b.add_argument_group("the server's API key and TLS"))


def config_from_args(args: argparse.Namespace, environ=os.environ) -> BenchConfig:
    """The run's settings; ValueError on a caller's mistake."""
    return BenchConfig(
        backend=args.backend, url=args.url, endpoint=args.endpoint, model=args.model,
        loads=parse_loads(args.concurrency, args.request_rate),
        max_concurrency=args.max_concurrency, num_prompts=args.num_prompts,
        input_len=LengthDist.parse(args.input_len), output_len=LengthDist.parse(args.output_len),
        prompts_file=args.prompts_file, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, ignore_eos=not args.respect_eos,
        speculative={"auto": None, "on": True, "off": False}[args.speculative],
        warmup=args.warmup, timeout_s=args.timeout, json_path=args.json_path or None,
        plot_path=args.plot_path or None, progress=not args.no_progress,
        api_key=args.api_key if args.api_key is not None else environ.get(API_KEY_ENV) or None,
        tls=TlsFiles.load(args.tls_cert, args.tls_key, args.tls_ca))


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; exit 1 when a load point had failed requests."""
    from router.bench.report import format_table, plot, write_json
    from router.bench.runner import run_bench

    config = config_from_args(args)
    try:
        report = asyncio.run(run_bench(config))
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if config.json_path:
        write_json(report, config.json_path)
        print(f"wrote {config.json_path}", file=sys.stderr)
    if config.plot_path:
        plot(report, config.plot_path)
        print(f"wrote {config.plot_path}", file=sys.stderr)
    failed = [p for p in report.points if p.summary.failed]
    for p in failed:
        print(f"warning: {p.load.label}: {p.summary.failed} requests failed, the first with: "
              f"{p.summary.first_error}", file=sys.stderr)
    print(f"{report.model} via {config.backend} at {config.url}: {config.num_prompts} requests "
          f"per load point, input {config.input_len}, output {config.output_len} tokens")
    print(format_table(report))
    return 1 if failed else 0
