"""Command-line settings both workers share, turned into frozen engine configs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys

import torch

from common.cache.sizing import DEFAULT_NUM_PAGES, DEFAULT_NUM_SLOTS, PoolRequest, SizingError
from common.cpu_threads import worker_cpu_threads
from common.engine.cuda_graph import CudaGraphConfig
from common.engine.factory import EngineSettings
from common.engine.llm_engine import CacheConfig, EngineConfig
from common.engine.loop import serial_main_thread
from common.host_malloc import tune_host_malloc
from common.lifecycle import die_with_parent_if_asked
from common.logging_setup import configure_logging
from common.metrics.tls import metrics_ssl_context
from common.parallel.placement import rank_devices
from common.parallel.worker_group import check_tp_args, shares_pools_at, takes_rank_streams
from common.engine.scheduler import SchedulerConfig, default_max_prefill_tokens

log = logging.getLogger(__name__)

# a worker process's GIL switch interval (Python's default is 5 ms)
GIL_SWITCH_INTERVAL_S = 0.0005


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
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
    )


def cuda_graph_from_args(args: argparse.Namespace) -> CudaGraphConfig:
    if args.cuda_graph_max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be at least 1, got {args.cuda_graph_max_bs}")
    ahead = getattr(args, "speculative_ahead", "off")
    return CudaGraphConfig(enabled=not args.disable_cuda_graph,
                           max_batch_size=args.cuda_graph_max_bs,
                           draft_ahead=ahead in ("draft", "step"), verify_ahead=ahead == "step",
                           step_ahead_if_planned=ahead == "auto",
                           tensor_parallel=getattr(args, "tp_cuda_graphs", False))


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
                settings.engine, cpu_threads=engine_cpu_threads(args, group.world_size)))
        yield group, build_engine(settings, tp=engine_tp(group, tp))


def engine_cpu_threads(args: argparse.Namespace, world_size: int) -> int:
    """The engine thread's torch threads on the CPU: rank 0's share of ``--cpu-threads`` (the
    group set it on entering), or all of them in a group of one. The calling (main) thread
    keeps one (``serial_main_thread``)."""
    threads = serial_main_thread()
    if world_size > 1:
        return threads
    chosen = worker_cpu_threads(args.cpu_threads)
    log.info("engine thread: %d CPU threads (--cpu-threads %d)", chosen, args.cpu_threads)
    return chosen


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
        takes_rank_streams(args, args.handoff_transport)
        worker_cpu_threads(args.cpu_threads)  # a negative count
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
    """Logging, a short GIL switch interval (the engine thread and the asyncio loop share the
    GIL, and at the default 5 ms every token waits up to that long to reach the network), and
    malloc settings that keep handoff-sized buffers in the process (``common/host_malloc.py``)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    tune_host_malloc()
    die_with_parent_if_asked()
    setup_logging(level, log_format)


def setup_logging(level: str, log_format: str = "text") -> None:
    configure_logging(level, log_format)
