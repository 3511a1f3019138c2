"""Command-line settings both workers share, turned into frozen engine configs."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig
from common.lifecycle import die_with_parent_if_asked
from common.security import add_security_args
from common.engine.scheduler import SchedulerConfig


HANDOFF_TRANSPORTS = ("auto", "stream", "device")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (it is printed)")
    p.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny' (built in)")
    p.add_argument("--handoff-transport", choices=HANDOFF_TRANSPORTS, default="auto",
                   help="how prompt state moves from prefill to decode: 'stream' (gRPC bytes, "
                        "works anywhere), 'device' (same host: the decode worker copies out of "
                        "the prefill worker's pools through CUDA IPC or shared memory), 'auto' "
                        "(device where both ends can, else stream) (default: %(default)s)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the config's)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=2048, help="KV pages, scratch page included")
    p.add_argument("--num-slots", type=int, default=65, help="GDN state slots, scratch included")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="token budget of one prefill step (the chunk size of long prompts)")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--draft", default=None,
                   help="DFLASH draft: 'tiny' (pairs with the built-in model) or a z-lab format "
                        "checkpoint directory; on by default for every request when given")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per DFLASH step (default: the draft's own block_size)")
    add_kernel_args(p)
    add_cuda_graph_args(p)
    add_security_args(p)
    p.add_argument("--grace", type=float, default=5.0,
                   help="on SIGTERM, seconds running requests get to finish before they end "
                        "with finish reason ABORT")
    p.add_argument("--log-level", default="INFO")


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
    from common.ops.gpu_backends import BACKEND_SETS

    p.add_argument("--kernels", default="auto", choices=("auto", *BACKEND_SETS),
                   help="kernel set (docs/kernels.md); auto: 'gpu' on a CUDA device, else "
                        "'reference'")


def kernels_from_args(args: argparse.Namespace):
    """The model's kernels for ``--kernels`` on ``--device`` (logged once)."""
    from common.ops.gpu_backends import describe, select_kernels

    name = args.kernels
    if name == "auto":
        name = "gpu" if str(args.device).startswith("cuda") else "reference"
    logging.getLogger(__name__).info("kernels %s", describe(name))
    return select_kernels(name)


def engine_config_from_args(args: argparse.Namespace, *, prefill: bool) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_pages,
                          num_slots=args.num_slots),
        scheduler=SchedulerConfig(max_prefill_tokens=args.max_prefill_tokens,
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


def build_engine(args: argparse.Namespace, *, prefill: bool):
    """Model, optional draft and engine for a worker, with the handoff layout and model
    fingerprint both sides must agree on; returns ``(engine, layout, fingerprint)``."""
    from common.engine.llm_engine import LLMEngine
    from common.handoff.layout import LayoutDescriptor, model_fingerprint
    from common.model.dflash import load_draft
    from common.model.load import eos_token_ids_for, load_model, weights_identity

    model = load_model(args.model, dtype=dtype_from_args(args), device=args.device,
                       kernels=kernels_from_args(args))
    draft = load_draft(args.draft, model) if args.draft else None
    config = engine_config_from_args(args, prefill=prefill)
    engine = LLMEngine(model, config, eos_token_ids_for(args.model, model.config), draft=draft,
                       block_size=args.block_size)
    start = time.perf_counter()
    engine.warmup()
    logging.getLogger(__name__).info("warm-up took %.1f s", time.perf_counter() - start)
    layout = LayoutDescriptor.from_model(model.config, config.cache.page_size, model.dtype)
    return engine, layout, model_fingerprint(model.config, weights_identity(args.model))


def dtype_from_args(args: argparse.Namespace) -> torch.dtype | None:
    return getattr(torch, args.dtype) if args.dtype else None


def run_worker(args: argparse.Namespace, serve) -> int:
    """A worker's process: logging, its security flags checked before the model loads (exit 2
    on a flag or file the caller got wrong), then ``asyncio.run(serve(args, security))``, whose
    result is the exit status (1 when a port cannot be bound)."""
    import asyncio
    import os

    from common.security import security_from_args

    setup_process(args.log_level)
    try:
        security = security_from_args(args, os.environ)
        security.internal_server()  # its flag combinations are checked before the model loads
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args, security))
    except OSError as exc:  # e.g. the port is in use
        print(f"error: {exc}", file=sys.stderr)
        return 1


def setup_process(level: str) -> None:
    """Logging, and a short GIL switch interval: the engine thread and the asyncio loop share
    the GIL, and at the default 5 ms every token waits up to that long to reach the network."""
    sys.setswitchinterval(0.0005)
    die_with_parent_if_asked()
    setup_logging(level)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
