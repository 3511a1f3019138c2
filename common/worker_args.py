"""Command-line settings both workers share, turned into frozen engine configs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

import torch

from common.cache.sizing import DEFAULT_NUM_PAGES, DEFAULT_NUM_SLOTS, PoolRequest, SizingError
from common.engine.cuda_graph import CudaGraphConfig
from common.engine.factory import EngineSettings
from common.engine.llm_engine import CacheConfig, EngineConfig
from common.engine.loop import serial_main_thread
from common.lifecycle import die_with_parent_if_asked
from common.progress import NO_PROGRESS_ENV
from common.logging_setup import add_log_format_arg, configure_logging
from common.metrics.server import add_metrics_port_arg
from common.metrics.tls import metrics_ssl_context
from common.model.registry import DEFAULT_MODEL
from common.parallel.launch import rank_devices
from common.parallel.worker_group import (add_tp_arg, check_tp_args, shares_pools_at,
                                          takes_rank_streams)
from common.security import add_security_args
from common.engine.scheduler import SchedulerConfig, default_max_prefill_tokens
from common.handoff.transports import HANDOFF_TRANSPORTS, takes_tcp_with

# a worker process's GIL switch interval (Python's default is 5 ms)
GIL_SWITCH_INTERVAL_S = 0.0005


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (it is printed)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint directory, or a built-in name: 'pycoder' (trained, ships in "
                        "the tree) or 'tiny' (random, for tests)")
    p.add_argument("--handoff-transport", choices=HANDOFF_TRANSPORTS, default="auto",
                   help="how prompt state moves from prefill to decode: 'stream' (bytes in "
                        "the gRPC stream, works anywhere), 'tcp' (bytes on a TCP connection "
                        "to the decode worker's --handoff-port beside the gRPC stream; "
                        "plaintext, so not with TLS), 'device' (same host: the decode worker "
                        "copies out of the prefill worker's pools through CUDA IPC or shared "
                        "memory; not with --tp above 1), 'auto' (device where both ends can, "
                        "else tcp where the listener is reachable and TLS is off, else "
                        "stream) (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the config's)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--mem-fraction", type=float, default=None, metavar="F",
                   help="size the KV pages and GDN state slots so that this worker uses at most "
                        "F of its device's total memory, weights, CUDA graphs and activations "
                        "included (measured at start-up); workers sharing a device need "
                        "fractions that add up to at most 1. On the CPU: F of physical "
                        "memory, less the weights. Default: fixed --num-pages and --num-slots "
                        "(docs/operations.md)")
    p.add_argument("--num-pages", type=int, default=None,
                   help=f"KV pages, scratch page included (default: {DEFAULT_NUM_PAGES}, or "
                        "what --mem-fraction leaves)")
    p.add_argument("--num-slots", type=int, default=None,
                   help=f"GDN state slots, scratch included (default: {DEFAULT_NUM_SLOTS}; "
                        "with --mem-fraction, --max-running-requests + 1)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="token budget of one prefill step (the chunk size of long prompts; "
                        "default: 8192 on a GPU, 2048 on the CPU)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="requests in one batch at most")
    p.add_argument("--draft", default=None,
                   help="DFLASH draft: 'tiny' (pairs with the built-in model) or a z-lab format "
                        "checkpoint directory; on by default for every request when given")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per DFLASH step (default: the draft's own block_size)")
    add_kernel_args(p)
    add_tp_arg(p)
    add_cuda_graph_args(p)
    add_security_args(p)
    p.add_argument("--grace", type=float, default=5.0,
                   help="on SIGTERM, seconds running requests get to finish before they end "
                        "with finish reason ABORT")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_progress_arg(p)
    add_log_format_arg(p)
    add_metrics_port_arg(p)


def add_progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars for weight loading and CUDA graph capture (they are "
                        f"drawn only when stderr is a terminal and {NO_PROGRESS_ENV} is unset)")


def add_cuda_graph_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run decode (and DFLASH verify) eagerly instead of replaying CUDA graphs")
    p.add_argument("--cuda-graph-max-bs", type=int, default=256,
                   help="largest batch captured in a CUDA graph; larger steps run eagerly")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens before launching the next (by default "
                        "plain decode steps replayed from CUDA graphs launch step n+1 first; "
                        "docs/cuda_graphs.md)")


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    from common.ops.gpu_backends import AUTO, BACKEND_SETS

    p.add_argument("--kernels", default=AUTO, choices=(AUTO, *BACKEND_SETS),
                   help="kernel set (docs/kernels.md); auto: 'gpu' on a CUDA device, else "
                        "'reference'")


def engine_config_from_args(args: argparse.Namespace, *, prefill: bool) -> EngineConfig:
    """The engine's settings, with the fixed pool sizes (``pool_request_from_args`` and
    ``size_engine_pools`` size them by memory)."""
    return EngineConfig(
        cache=CacheConfig(page_size=args.page_size,
                          num_pages=args.num_pages or DEFAULT_NUM_PAGES,
                          num_slots=args.num_slots or DEFAULT_NUM_SLOTS),
        scheduler=SchedulerConfig(max_prefill_tokens=args.max_prefill_tokens
                                  or default_max_prefill_tokens(
                                      rank_devices(args.device, args.tp)[0]),
                                  max_running_requests=args.max_running_requests,
                                  reserve_output_tokens=not prefill),
        device=args.device,
        hold_after_prefill=prefill,
        cuda_graph=cuda_graph_from_args(args),
        overlap_schedule=not args.disable_overlap_schedule,
    )


def cuda_graph_from_args(args: argparse.Namespace) -> CudaGraphConfig:
    if args.cuda_graph_max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be at least 1, got {args.cuda_graph_max_bs}")
    return CudaGraphConfig(enabled=not args.disable_cuda_graph,
                           max_batch_size=args.cuda_graph_max_bs)


def engine_settings_from_args(args: argparse.Namespace, *, prefill: bool) -> EngineSettings:
    """What a worker's engine is built from (``common.engine.factory.build_engine``): every
    worker warms up before it serves, and sizes its pools by the pool flags."""
    config = engine_config_from_args(args, prefill=prefill)
    return EngineSettings(model=args.model, draft=args.draft, block_size=args.block_size,
                          dtype=dtype_from_args(args), kernels=args.kernels, engine=config,
                          pools=pool_request_from_args(args, config, prefill=prefill),
                          warmup="always", progress=not args.no_progress,
                          expert_parallel=args.expert_parallel)


@contextlib.contextmanager
def worker_engine(args: argparse.Namespace, *, prefill: bool, follower_bands=None):
    """``with worker_engine(args, prefill=...) as (group, built):`` the worker's engine
    (``common.engine.factory.build_engine``), built on rank 0 of its ``--tp`` group, whose
    followers start here (each with ``follower_bands``, the service's handler of per-rank
    stream messages: ``common/parallel/band_messages.py``) and leave when the block ends."""
    from common.engine.factory import build_engine
    from common.parallel.worker_group import engine_tp, settings_for_group, worker_group

    group = worker_group(args, follower_bands)
    with group as tp:  # rank 0's share of a CPU's threads is set on entering
        settings = settings_for_group(engine_settings_from_args(args, prefill=prefill), group)
        if torch.device(settings.engine.device).type == "cpu":  # before the model loads
            settings = dataclasses.replace(settings, engine=dataclasses.replace(
                settings.engine, cpu_threads=serial_main_thread()))
        yield group, build_engine(settings, tp=engine_tp(group, tp))


def pool_request_from_args(args: argparse.Namespace, config: EngineConfig, *,
                           prefill: bool) -> PoolRequest:
    """What the pool flags ask for. A prefill worker that offers its pools to same-host decode
    workers (``--handoff-transport`` auto or device) copies them once at start-up."""
    from common.engine.pool_sizing import min_pages

    return PoolRequest(mem_fraction=args.mem_fraction, num_pages=args.num_pages,
                       num_slots=args.num_slots,
                       default_slots=config.scheduler.max_running_requests + 1,
                       min_pages=min_pages(config),
                       copied_at_start=prefill and shares_pools_at(args, args.handoff_transport))


def dtype_from_args(args: argparse.Namespace) -> torch.dtype | None:
    return getattr(torch, args.dtype) if args.dtype else None


def run_worker(args: argparse.Namespace, serve) -> int:
    """A worker's process: logging, its security and tensor-parallel flags checked before the
    model loads (exit 2 on a flag or file the caller got wrong, or a ``--tp`` that does not
    divide the model), then ``asyncio.run(serve(args, security))``, whose
    result is the exit status (1 when a port cannot be bound)."""
    import asyncio
    import os

    from common.security import security_from_args

    setup_process(args.log_level, args.log_format)
    try:
        security = security_from_args(args, os.environ)
        security.internal_server()  # its flag combinations are checked before the model loads
        if args.metrics_port is not None:  # its TLS files are checked before the model loads
            metrics_ssl_context(args.tls_cert, args.tls_key, args.tls_ca)
        takes_tcp_with(args.handoff_transport, security.tls)  # tcp is refused beside TLS
        takes_rank_streams(args, args.handoff_transport, security.tls)
        check_tp_args(args)  # ShardingError names what the size must divide
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args, security))
    except SizingError as exc:  # pools that do not fit: the flags must change
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is in use
        print(f"error: {exc}", file=sys.stderr)
        return 1


def setup_process(level: str, log_format: str = "text") -> None:
    """Logging, and a short GIL switch interval: the engine thread and the asyncio loop share
    the GIL, and at the default 5 ms every token waits up to that long to reach the network."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    die_with_parent_if_asked()
    setup_logging(level, log_format)


def setup_logging(level: str, log_format: str = "text") -> None:
    configure_logging(level, log_format)
