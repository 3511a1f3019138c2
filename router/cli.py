"""The ``flashsplit`` command: ``generate`` (in process or through a router), ``up``, ``demo``,
``bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from common.cli_help import HelpFormatter
from common.logging_setup import EchoWriter, add_log_format_arg
from common.model.registry import DEFAULT_MODEL
from common.sampling import SamplingParams
from router.sampling_args import (add_sampling_args, logprobs_json, parse_ids,
                                  sampling_from_args, speculative_choice)
from common.security import add_client_args, client_channel_from
from common.worker_flags import TP_CUDA_GRAPHS_HELP

_DESCRIPTION = ("flashsplit serves hybrid Gated-DeltaNet models (Qwen3.5, Qwen3-Next) with "
                "prefill and decode as separate gRPC services behind a router. "
                "'flashsplit COMMAND --help' lists a command's flags.")


def add_model_args(p: argparse.ArgumentParser) -> None:
    from common.worker_flags import add_kernel_args

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint directory, or a built-in name: 'tiny' (random weights) or "
                        "'pycoder' (trained; common/model/registry.py)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the config's)")
    add_kernel_args(p)


# Worker flags that `flashsplit up` passes through unchanged (--device is spread over workers).
_WORKER_FLAGS = ("--dtype", "--page-size", "--num-pages", "--num-slots", "--max-prefill-tokens",
                 "--max-running-requests", "--draft", "--block-size",
                 "--speculative-disable-by-batch-size", "--speculative-ahead", "--kernels",
                 "--cuda-graph-max-bs", "--handoff-transport", "--tp-handoff", "--cpu-threads")
# where `up` itself does something when the flag is not given
_UP_HELP = {"--cpu-threads": "on the CPU: every worker's threads (0: every CPU it may use); "
                             "default: the CPU workers share the host's CPUs evenly, a --tp N "
                             "worker taking N shares (docs/operations.md, CPU threads)"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashsplit", description=_DESCRIPTION,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")

    gen = sub.add_parser("generate", help="generate from one prompt, in this process or "
                                           "through a router (--router)",
                         description="Generate from one prompt: in this process (the model "
                                     "loads here), or through a running router with --router.",
                         formatter_class=HelpFormatter)
    add_model_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=str, help="the prompt text")
    src.add_argument("--prompt-ids", type=str, help="comma-separated token ids")
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--router", metavar="ADDR", default=None,
                     help="host:port of a flashsplit router; the router tokenizes, so --model, "
                          "--device and --dtype are not used")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="with --router: end the text before this string (repeatable)")
    gen.add_argument("--timeout", type=float, default=600.0,
                     help="seconds the whole call may take (with --router)")
    gen.add_argument("--draft", default=None,
                     help="DFLASH draft for in-process generation: 'pycoder' (the built-in "
                          "model's), 'tiny' or a checkpoint dir "
                          "(through a router the draft is the decode workers': up --draft)")
    gen.add_argument("--block-size", type=int, default=None,
                     help="tokens per DFLASH step, in process (default: the draft's)")
    gen.add_argument("--speculative", choices=("auto", "on", "off"), default="auto",
                     help="speculative decoding for this request (auto: when a draft is there)")
    gen.add_argument("--tp", type=int, default=1, metavar="N",
                     help="in process: shard the model over N processes (tensor parallelism; "
                          "one device each: --device cuda gives cuda:0..N-1, the CPU is shared)")
    gen.add_argument("--expert-parallel", action="store_true",
                     help="with --tp: place a MoE model's routed experts whole on the ranks "
                          "(default: each expert's matrices split over them)")
    gen.add_argument("--tp-cuda-graphs", action="store_true", help=TP_CUDA_GRAPHS_HELP)
    add_client_args(gen.add_argument_group("with --router: the router port's API key and TLS"))

    up = sub.add_parser("up", help="start prefill and decode workers and a router on this host",
                        description="Start prefill and decode workers and a router as "
                                    "processes on this host; restart workers that exit; stop "
                                    "them all on SIGINT/SIGTERM.",
                        formatter_class=HelpFormatter)
    up.add_argument("--model", default=DEFAULT_MODEL,
                    help="checkpoint directory, or a built-in name: 'tiny' (random weights) or "
                         "'pycoder' (trained; common/model/registry.py)")
    up.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    up.add_argument("--port", type=int, default=0, help="the router's port; 0 = any free port")
    up.add_argument("--http-port", type=int, default=None, metavar="PORT",
                    help="the router also serves the OpenAI-compatible HTTP API on this port "
                         "(0 = any free port; default: no HTTP API)")
    up.add_argument("--prefill-workers", type=int, default=1, help="prefill worker processes")
    up.add_argument("--decode-workers", type=int, default=1, help="decode worker processes")
    for kind in ("prefill", "decode"):  # the two sizes need not be equal
        up.add_argument(f"--{kind}-tp", type=int, default=1, metavar="N",
                        help=f"each {kind} worker's --tp: the model sharded over N processes")
    up.add_argument("--device", default=None,
                    help="device of every worker, or a comma-separated list given to the "
                         "workers in order, prefill first (e.g. cuda:0,cuda:1)")
    worker_help, worker_choices = _worker_flag_help(), _worker_flag_choices()
    for flag in _WORKER_FLAGS:
        # the worker's own choices: a wrong value fails here, before any process starts
        up.add_argument(flag, default=None, choices=worker_choices.get(flag),
                        help=_UP_HELP.get(flag, f"every worker's: {worker_help[flag]}"))
    up.add_argument("--mem-fraction", type=float, default=None, metavar="F",
                    help="size every worker's pools by memory: the workers that share a device "
                         "split F of its total memory evenly (one prefill and one decode "
                         "worker on one GPU: F/2 each; on the CPU, every worker shares the "
                         "host's); default: fixed --num-pages and --num-slots "
                         "(docs/operations.md)")
    up.add_argument("--disable-cuda-graph", action="store_true",
                    help=f"every worker's: {worker_help['--disable-cuda-graph']}")
    up.add_argument("--disable-overlap-schedule", action="store_true",
                    help=f"every worker's: {worker_help['--disable-overlap-schedule']}")
    up.add_argument("--expert-parallel", action="store_true",
                    help=f"every worker's: {worker_help['--expert-parallel']}")
    up.add_argument("--tp-cuda-graphs", action="store_true",
                    help=f"every worker's: {worker_help['--tp-cuda-graphs']}")
    up.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds each process may take to become ready")
    up.add_argument("--grace", type=float, default=5.0,
                    help="on SIGINT/SIGTERM, seconds running requests get to finish before "
                         "they end with finish reason ABORT (also each process's --grace)")
    up.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="passed to the router (default: what the workers' pools hold)")
    up.add_argument("--first-token-after-handoff", action="store_true",
                    help="passed to the router: stream each first token from decode once the "
                         "handoff is acknowledged, not from prefill as soon as it is sampled")
    up.add_argument("--mps", action="store_true",
                    help="run the workers under a CUDA MPS daemon of the cluster's own, so "
                         "that workers sharing a GPU run their kernels side by side instead "
                         "of taking turns on it (docs/operations.md)")
    up.add_argument("--quiet", action="store_true", help="do not echo the processes' logs")
    add_log_format_arg(up)  # every process's, and the echo of them all
    # Modules that serve the workers; tests point them at fakes that speak the same protocol.
    up.add_argument("--prefill-module", default="prefill_service", help=argparse.SUPPRESS)
    up.add_argument("--decode-module", default="decode_service", help=argparse.SUPPRESS)

    demo = sub.add_parser("demo", help="generate a few prompts on the built-in model",
                          description="Start a local cluster, send it a few prompts, print "
                                      "their text and latencies.",
                          formatter_class=HelpFormatter)
    add_model_args(demo)
    demo.add_argument("--max-new-tokens", type=int, default=24,
                      help="tokens to generate per prompt")

    from router.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from common.training.draft_cli import add_train_draft_parser

    add_train_draft_parser(sub)
    return parser


def _worker_flag_help() -> dict[str, str]:
    """Each worker flag's help text, defaults filled in, for ``up``'s copies of them."""
    from common.worker_flags import add_worker_args

    worker = argparse.ArgumentParser(add_help=False, formatter_class=HelpFormatter)
    add_worker_args(worker)
    formatter = worker._get_formatter()
    return {flag: formatter._expand_help(action).replace("%", "%%")
            for action in worker._actions for flag in action.option_strings}


def _worker_flag_choices() -> dict[str, tuple[str, ...]]:
    """The worker flags of ``_WORKER_FLAGS`` that take one of a fixed set of values."""
    from common.worker_flags import TP_HANDOFF_PATHS

    return {"--tp-handoff": TP_HANDOFF_PATHS}


def run_local(args: argparse.Namespace, prompts: list[list[int]],
              params: SamplingParams) -> tuple[list, float]:
    """Load the model (and draft), run ``prompts`` to completion; return requests, seconds."""
    from common.engine.cuda_graph import CudaGraphConfig
    from common.engine.factory import EngineSettings, build_engine
    from common.engine.llm_engine import EngineConfig
    from common.worker_args import dtype_from_args

    from common.parallel.launch import LocalGroup

    if speculative_choice(args) and not args.draft:
        raise ValueError("--speculative on needs --draft")
    if args.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {args.tp}")
    group = LocalGroup(args.tp, args.device)
    # graphs for the batch sizes this run can have (captured by the warm-up, on a GPU only)
    graphs = CudaGraphConfig(max_batch_size=max(1, len(prompts)),
                             tensor_parallel=args.tp_cuda_graphs)
    settings = EngineSettings(model=args.model, draft=args.draft, block_size=args.block_size,
                              dtype=dtype_from_args(args), kernels=args.kernels,
                              engine=EngineConfig(device=group.device, cuda_graph=graphs),
                              progress=True, tensor_parallel_size=args.tp,  # a bar on terminals
                              expert_parallel=args.expert_parallel)
    if args.tp > 1:
        from common.model.registry import load_config
        from common.parallel.shard_plan import ShardPlan

        # refused before any process starts
        ShardPlan.for_rank(load_config(args.model), 0, args.tp,
                           expert_parallel=args.expert_parallel)
    with group as tp:
        engine = build_engine(settings, tp=tp if args.tp > 1 else None).engine
        start = time.perf_counter()
        reqs = engine.generate(prompts, params)
        return reqs, time.perf_counter() - start


def cmd_generate(args: argparse.Namespace) -> int:
    from common.tokenizer import load_tokenizer

    params = sampling_from_args(args)
    if args.router is not None:
        if args.tp != 1:
            raise ValueError("--tp is for in-process generation: through a router, the "
                             "workers' parallel sizes are theirs")
        for flag in ("draft", "block_size"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} is for in-process generation: "
                                 "through a router, the draft is the decode workers' (start "
                                 "them with --draft, e.g. flashsplit up --draft tiny)")
        return generate_remote(args, params)
    if args.stop:
        raise ValueError("--stop is matched by the router: use it with --router")
    tokenizer = load_tokenizer(args.model, allow_missing=True)
    prompt = parse_ids(args.prompt_ids) if args.prompt_ids is not None \
        else tokenizer.encode(args.prompt)
    (req,), seconds = run_local(args, [prompt], params)
    text = tokenizer.decode(req.output_ids)
    if args.json:
        print(json.dumps({"token_ids": req.output_ids, "text": text,
                          "prompt_tokens": len(prompt), "finish_reason": req.finish_reason,
                          "seconds": round(seconds, 6), "accept_lengths": req.accept_lengths,
                          **logprobs_json(params, req.logprobs)}))
    else:
        print(text)
    return 0


def generate_remote(args: argparse.Namespace, params: SamplingParams) -> int:
    """``generate --router``: stream one completion from a router (the router tokenizes)."""
    import asyncio

    import grpc

    from router.remote import generate, request_to_pb

    if args.prompt_ids is not None:
        req = request_to_pb(token_ids=parse_ids(args.prompt_ids), params=params, stop=args.stop)
    else:
        req = request_to_pb(text=args.prompt, params=params, stop=args.stop)

    def show(text: str) -> None:
        print(text, end="", flush=True)

    try:
        out = asyncio.run(generate(args.router, req, timeout_s=args.timeout,
                                   on_text=None if args.json else show,
                                   security=client_channel_from(args, os.environ)))
    except grpc.aio.AioRpcError as exc:
        if not args.json:
            print()
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text,
                          "prompt_tokens": out.prompt_tokens, "finish_reason": out.finish_reason,
                          "seconds": round(out.seconds, 6),
                          "time_to_first_token_s": out.time_to_first_token_s,
                          "inter_token_latencies_s": out.inter_token_latencies_s,
                          "accept_lengths": out.accept_lengths,
                          **logprobs_json(params, out.logprobs)}))
    else:
        print()
    return 0


def cluster_config_from_args(args: argparse.Namespace):
    from router.cluster import ClusterConfig

    worker_args: list[str] = []
    for flag in _WORKER_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            worker_args += [flag, str(value)]
    for flag in ("--disable-cuda-graph", "--disable-overlap-schedule", "--expert-parallel",
                 "--tp-cuda-graphs"):
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            worker_args.append(flag)
    devices = tuple(d for d in (args.device or "").split(",") if d)
    router_args = (() if args.max_prompt_tokens is None
                   else ("--max-prompt-tokens", str(args.max_prompt_tokens)))
    if args.first_token_after_handoff:
        router_args += ("--first-token-after-handoff",)
    return ClusterConfig(model=args.model, host=args.host, router_port=args.port,
                         num_prefill=args.prefill_workers, num_decode=args.decode_workers,
                         prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                         worker_args=tuple(worker_args), devices=devices,
                         mem_fraction=args.mem_fraction,
                         router_args=router_args, grace_s=args.grace,
                         start_timeout_s=args.start_timeout, echo_logs=not args.quiet,
                         prefill_module=args.prefill_module, decode_module=args.decode_module,
                         router_http_port=args.http_port, metrics=True,
                         log_format=args.log_format, mps=args.mps)


def cmd_up(args: argparse.Namespace) -> int:
    """Run a local cluster until SIGINT/SIGTERM, restarting workers that exit or stop serving
    (router/supervisor.py); exit 1 if the router dies."""
    import asyncio
    import signal
    import threading

    from router.cluster import Cluster, ClusterError
    from router.supervisor import Supervisor, SupervisorConfig

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = Cluster(cluster_config_from_args(args))
    try:
        cluster.start()
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"router listening on {cluster.router_address}", flush=True)
        if cluster.router.http_address:
            print(f"OpenAI-compatible HTTP API on {cluster.http_url}/v1", flush=True)
        for w in cluster.workers:
            print(f"{w.name} on {w.address} (pid {w.pid})", flush=True)
        for p in [cluster.router, *cluster.workers]:
            if p.metrics_url:
                print(f"{p.name} metrics on {p.metrics_url}", flush=True)
        # a worker drains for its grace before it exits: not a hang
        watch = SupervisorConfig(not_serving_after_s=max(SupervisorConfig.not_serving_after_s,
                                                         args.grace + 5.0))
        out = EchoWriter(sys.stderr, "up", args.log_format)
        return asyncio.run(Supervisor(cluster, watch, out=out).run(stop))
    finally:
        cluster.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    from router.demo import run_demo

    return run_demo(model=args.model, max_new_tokens=args.max_new_tokens, device=args.device,
                    kernels=args.kernels)


def cmd_bench(args: argparse.Namespace) -> int:
    from router.bench.cli import cmd_bench as run

    return run(args)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from common.training.draft_cli import cmd_train_draft as run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"generate": cmd_generate, "up": cmd_up, "demo": cmd_demo,
               "bench": cmd_bench, "train-draft": cmd_train_draft}[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
