"""A worker's tensor-parallel group (``flashsplit-prefill --tp N``, ``flashsplit-decode --tp
N``): the worker's process is rank 0 and serves gRPC and drives the schedule; its N-1 followers
are processes it spawns on this host (``LocalGroup``), so to the router the worker is still one
address.

What the flags may not combine is refused here, before any process starts or any port is bound
(exit 2 through ``run_worker``), with the message that says what must change: a size that does
not divide the model's heads (``ShardingError``). Pools sized by ``--mem-fraction`` are sized
by rank 0 for every rank (``common/engine/pool_sizing.py``). The ``device`` handoff transport
(the peer copies straight out of the sender's pools) is not offered by a sharded worker: each
rank's pools hold only its heads, so its handoffs go as bytes of the full state (over TCP or
in the gRPC stream) through rank 0 (``common/parallel/prompt_state.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from common.engine.factory import EngineSettings
from common.parallel.band_messages import BandHandlerFactory
from common.parallel.launch import LocalGroup

log = logging.getLogger(__name__)

def check_tp_args(args: argparse.Namespace) -> None:
    """Raises ValueError (ShardingError: what does not divide) for a ``--tp`` that cannot
    serve this model with these flags."""
    if args.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {args.tp}")
    if args.tp == 1:
        return
    from common.model.registry import load_config
    from common.parallel.shard_plan import ShardPlan

    ShardPlan.for_rank(load_config(args.model), 0, args.tp,
                       expert_parallel=args.expert_parallel)


def worker_group(args: argparse.Namespace,
                 follower_bands: BandHandlerFactory | None = None) -> LocalGroup:
    """``with worker_group(args) as tp:`` this process as rank 0 of ``args.tp`` ranks, the
    followers started (a group of one at ``--tp 1``: nothing starts). ``follower_bands``: the
    worker's handler of per-rank stream messages, made on each follower."""
    return LocalGroup(args.tp, args.device, follower_bands=follower_bands,
                      cpu_threads=args.cpu_threads)


def settings_for_group(settings: EngineSettings, group: LocalGroup) -> EngineSettings:
    """``settings`` for rank 0 of ``group``: its size, and rank 0's own device (``cuda``
    means ``cuda:0`` then)."""
    if group.world_size == 1:
        return settings
    return dataclasses.replace(settings, tensor_parallel_size=group.world_size,
                               engine=dataclasses.replace(settings.engine,
                                                          device=group.device))


def engine_tp(group: LocalGroup, tp):
    """What ``build_engine(tp=)`` takes: the group above one rank, else None."""
    return tp if group.world_size > 1 else None


def handoff_transport(args: argparse.Namespace, side: str) -> str:
    """The handoff transport this worker uses: ``args.handoff_transport``, except that a
    sharded worker neither offers (prefill) nor opens (decode) pools: ``device`` becomes
    ``stream`` (with a warning) and ``auto`` keeps its other choices (``tcp``, else the
    stream); see :func:`shares_pools_at`."""
    asked = args.handoff_transport
    if args.tp == 1 or asked not in ("auto", "device"):
        return asked
    verb = "offered" if side == "prefill" else "opened"
    (log.warning if asked == "device" else log.info)(
        "--tp %d: the device handoff transport is not %s (each rank's pools hold only its "
        "heads); handoffs carry the full state as bytes, through rank 0", args.tp, verb)
    return "stream" if asked == "device" else asked


def shares_pools_at(args: argparse.Namespace, transport: str) -> bool:
    """Whether this worker offers (prefill) or opens (decode) same-host pools: its transport
    allows it and its pools hold the whole model (no ``--tp``)."""
    from common.handoff.transports import shares_pools

    return args.tp == 1 and shares_pools(transport)


def takes_rank_streams(args: argparse.Namespace, transport: str) -> bool:
    """Whether this worker offers (prefill) or takes (decode) per-rank handoff streams: not
    ``--tp-handoff leader``, and its chunks may go over TCP. ``--tp-handoff ranks`` where they
    may not is a caller mistake (ValueError)."""
    from common.handoff.transports import takes_tcp

    if args.tp_handoff == "leader":
        return False
    if not takes_tcp(transport):
        if args.tp_handoff == "ranks":
            raise ValueError("--tp-handoff ranks sends each rank's state over TCP: it needs "
                             "--handoff-transport auto or tcp")
        return False
    return True
