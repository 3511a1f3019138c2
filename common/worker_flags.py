"""The command-line flags of a worker process (``python -m prefill_service`` / ``-m
decode_service``), which ``flashsplit up`` also offers and passes on.

Declaring them imports no torch: ``flashsplit`` builds its parser (and ``up`` runs its
supervisor) without it. What the flags become is ``common.worker_args``.
"""

from __future__ import annotations

import argparse

from common.cache.sizing import DEFAULT_NUM_PAGES, DEFAULT_NUM_SLOTS
from common.handoff.transports import HANDOFF_TRANSPORTS
from common.logging_setup import add_log_format_arg
from common.metrics.server import add_metrics_port_arg
from common.model.registry import DEFAULT_MODEL
from common.progress import NO_PROGRESS_ENV
from common.security import add_security_args

__all__ = ["TP_CUDA_GRAPHS_HELP", "TP_HANDOFF_PATHS", "add_cuda_graph_args", "add_kernel_args", "add_progress_arg",
           "add_tp_arg", "add_worker_args"]

TP_HANDOFF_PATHS = ("auto", "ranks", "leader")


def add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="shard the model over N processes on this host (tensor parallelism): "
                        "this process is rank 0 and serves; it starts the other N-1 "
                        "(docs/tensor_parallel.md). On the CPU they share the host's cores")
    p.add_argument("--tp-handoff", choices=TP_HANDOFF_PATHS, default="auto",
                   help="how a handoff's state moves when either end is sharded: 'ranks' (each "
                        "rank sends or lands its own heads on a TCP stream of its own; a "
                        "handoff the other end cannot take so fails), 'leader' (everything "
                        "gathered to, or scattered from, rank 0), 'auto' (ranks where both "
                        "ends can, else leader). Per-rank streams need TCP (TLS when the "
                        "workers have it): not with --handoff-transport stream "
                        "(docs/tensor_parallel.md) (default: %(default)s)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tp: place a MoE model's routed experts whole on the ranks "
                        "(default: each expert's matrices split over them)")
    p.add_argument("--tp-cuda-graphs", action="store_true",
                   help=TP_CUDA_GRAPHS_HELP)


TP_CUDA_GRAPHS_HELP = ("with --tp above 1 on GPUs: replay decode (and DFLASH verify) steps from "
                       "CUDA graphs on every rank, NCCL collectives captured inside them, and "
                       "overlap decode steps; off by default, as it has not yet run on "
                       "several GPUs (docs/tensor_parallel.md)")


# --speculative-ahead's choices: what of the next DFLASH step is launched before the read
SPECULATIVE_AHEAD = ("auto", "off", "draft", "step")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (it is printed)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint directory, or a built-in name: 'pycoder' (trained, ships in "
                        "the tree) or 'tiny' (random, for tests)")
    p.add_argument("--handoff-transport", choices=HANDOFF_TRANSPORTS, default="auto",
                   help="how prompt state moves from prefill to decode: 'stream' (bytes in "
                        "the gRPC stream, works anywhere), 'tcp' (bytes on a TCP connection "
                        "to the decode worker's --handoff-port beside the gRPC stream; TLS "
                        "when the workers have it), 'device' (same host: the decode worker "
                        "copies out of the prefill worker's pools through CUDA IPC or shared "
                        "memory; not with --tp above 1), 'auto' (device where both ends can, "
                        "else tcp where the listener is reachable, else stream) (default: "
                        "%(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--cpu-threads", type=int, default=0, metavar="N",
                   help="on the CPU: the threads this worker computes with, its --tp ranks "
                        "sharing them (default 0: every CPU it may use, a container's CPU "
                        "limit included). Workers on one host should share its cores: "
                        "`flashsplit up` gives the CPU workers it starts an even share "
                        "(docs/operations.md)")
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
                   help="DFLASH draft: a built-in model's trained draft by the model's name "
                        "('pycoder'), 'tiny' (random, pairs with --model tiny) or a z-lab "
                        "format checkpoint directory; on by default for every request when given")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per DFLASH step (default: the draft's own block_size)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                   help="decode workers: a request that leaves speculation to the server "
                        "decodes without the draft when it arrives while N requests are "
                        "already decoding or waiting (default: always speculate)")
    p.add_argument("--speculative-ahead", choices=SPECULATIVE_AHEAD, default="auto",
                   help="decode workers, greedy DFLASH steps in CUDA graphs: launch the next "
                        "step's draft ('draft'), or its draft and verify ('step': needs "
                        "attention that plans on the device, --kernels gpu-triton-attention), "
                        "before the host reads the step; 'auto' is 'step' where the attention "
                        "plans on the device and 'off' elsewhere (docs/cuda_graphs.md) "
                        "(default: %(default)s)")
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
                   help="kernel set (docs/kernels.md); auto: 'gpu' on a CUDA device "
                        "('gpu-triton-attention' for a decode worker with a draft, or where "
                        "FlashInfer does not load), else 'cpu' ('reference' is the plain-torch "
                        "definition)")
