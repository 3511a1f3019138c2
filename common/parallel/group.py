"""The tensor-parallel group of one worker: its rank, its size and the collectives its layers call.

A group is passed explicitly to everything that shards or communicates (the model, the engine's
runner, the followers); nothing here is global. The process groups are made directly from a
``TCPStore`` rather than through ``torch.distributed.init_process_group``, so that one process can
hold a group without registering a default world, and a test process can build several groups in
turn.

World size 1 is :meth:`TensorParallelGroup.single`: no process group at all, and every collective
returns its input untouched, so a single-device model runs exactly the code it ran before
tensor parallelism existed. A group of one rank *with* process groups (:func:`process_groups`)
runs its collectives for real: how one GPU exercises NCCL inside the captured graphs.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's view of its tensor-parallel group.

    Attributes:
        rank: this process's rank, 0 .. world_size-1; rank 0 drives the schedule.
        world_size: the number of ranks the model is sharded over.
        device_group: the process group the layers' collectives run on (NCCL for CUDA tensors,
            gloo on the CPU); None at world size 1.
        cpu_group: a gloo group for host-side messages (the step broadcast); the same object
            as ``device_group`` on the CPU; None at world size 1.
        store: the group's rendezvous store, which stays up while the group does: per-rank
            handoff streams report through it from any thread, out of step with the
            collectives (``common/parallel/band_messages.py``); None at world size 1.

    At world size 1 the process groups may be given (:func:`process_groups`): the layers'
    collectives then run on them, which leave every tensor as it was.
    """

    rank: int = 0
    world_size: int = 1
    device_group: object | None = None
    cpu_group: object | None = None
    store: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size}")
        if self.world_size > 1 and (self.device_group is None or self.cpu_group is None):
            raise ValueError("a group of more than one rank needs its process groups")

    @classmethod
    def single(cls) -> "TensorParallelGroup":
        """World size 1: no communication."""
        return cls()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # collectives the layers call; each is the identity at world size 1
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place; returns ``x``)."""
        if self.device_group is None:
            return x
        self.device_group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dim, rank 0 first."""
        if self.device_group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.device_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_from_leader(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` in every rank's ``x`` (in place, on the device group: queued on the
        stream under NCCL, so a follower's next kernels read it without a host wait)."""
        if self.device_group is None:
            return x
        self.device_group.broadcast(x, 0).wait()
        return x

    # host messages
    def min_over_ranks(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """Each position's smallest value over the ranks (every rank passes its own and gets
        the same answer): how rank 0 learns, e.g., the free memory of the tightest device."""
        if self.world_size == 1:
            return tuple(values)
        t = torch.tensor(values, dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([t], options).wait()
        return tuple(int(v) for v in t.tolist())

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (pickled; two broadcasts: the length, then the bytes).
        Followers pass nothing and get rank 0's object."""
        if self.world_size == 1:
            return obj
        if self.is_leader:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.cpu_group.broadcast(size, 0).wait()
        if not self.is_leader:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.cpu_group.broadcast(payload, 0).wait()
        return obj if self.is_leader else pickle.loads(payload.numpy().tobytes())


def leader_store(world_size: int, host: str = "127.0.0.1",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port that the system picks (``store.port``), made
    before the followers start, so no port is chosen by guessing."""
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def connect(rank: int, world_size: int, *, store: dist.Store | None = None,
            host: str = "127.0.0.1", port: int | None = None, device: str = "cpu",
            timeout_s: float = DEFAULT_TIMEOUT_S,
            on_store: Callable[[dist.Store], None] | None = None) -> TensorParallelGroup:
    """Join the group: rank 0 passes its :func:`leader_store`, the others the store's host and
    port. ``device``: where the layers' tensors live (a CUDA device gets an NCCL device group
    beside the gloo one). ``on_store``: called with the store once it is reached, before the
    process groups' rendezvous.

    Raises ValueError for an impossible rank or a follower without an address.
    """
    if world_size == 1:
        return TensorParallelGroup.single()
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        if port is None:
            raise ValueError("a follower needs the leader store's port")
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if on_store is not None:
        on_store(store)
    return process_groups(store, rank, world_size, device=device, timeout_s=timeout_s)


def process_groups(store: dist.Store, rank: int, world_size: int, *, device: str = "cpu",
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelGroup:
    """The group of ``rank`` with its process groups made on ``store`` (gloo for host
    messages, and NCCL for the layers' collectives when ``device`` is a CUDA device). At world
    size 1 too: :func:`connect` gives :meth:`TensorParallelGroup.single` there instead."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # each group keys its rendezvous under its own prefix of the one store
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, world_size, timeout)
    device_group = cpu_group
    if torch.device(device).type == "cuda":
        # the options init_process_group would give a group of these ranks
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.is_high_priority_stream = False
        options.global_ranks_in_group = list(range(world_size))
        device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size,
                                             options)
    return TensorParallelGroup(rank, world_size, device_group, cpu_group, store)
