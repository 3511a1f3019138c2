"""A tensor-parallel group of processes on this host: this process is rank 0, and the
followers are spawned processes that run :class:`~common.parallel.followers.Follower`.

The rendezvous store listens on a port the system picks when rank 0 makes it, and the followers
are told that port when they start, so nothing chooses a port by guessing and two groups on one
host never collide.
"""

from __future__ import annotations

import logging
import multiprocessing
import time

from common.parallel.band_messages import BandHandlerFactory
from common.parallel.followers import Follower, FollowerLink
from common.parallel.group import (DEFAULT_TIMEOUT_S, TensorParallelGroup, connect,
                                   leader_store)
from common.parallel.placement import cpu_threads_per_rank, rank_devices

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0
STARTED_KEY = "started/"  # a follower sets started/<rank> once it has imported and connected
POLL_S = 0.05


def _follow(rank: int, world_size: int, port: int, device: str, timeout_s: float,
            bands: BandHandlerFactory | None = None, cpu_threads: int = 0) -> None:
    """A follower process's body."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:
        # the ranks share the host's cores: more threads than that would only wait for each
        # other inside every small op and every collective
        torch.set_num_threads(cpu_threads_per_rank(world_size, cpu_threads))
    tp = connect(rank, world_size, port=port, device=device, timeout_s=timeout_s,
                 on_store=lambda store: store.set(f"{STARTED_KEY}{rank}", "1"))
    Follower(tp, device, bands).run()


class LocalGroup:
    """``with LocalGroup(N, device) as tp:`` rank 0's group, its N-1 followers started and
    joined; on leaving, the followers are told to stop and are waited for (and ended if they
    do not stop). Inside, this process runs as rank 0: on the CPU with its share of the cores
    (``cpu_threads_per_rank``), on a GPU with its device current; both are restored on leaving.

    Args:
        world_size: ranks, this process included.
        device: as :func:`rank_devices` takes it; this process gets the first.
        timeout_s: how long any collective (and the rendezvous) may wait for a rank.
        follower_bands: what each follower runs per-rank handoff stream messages with (a
            top-level class or function: it is pickled into the spawned processes); None:
            the followers take none.
    """

    def __init__(self, world_size: int, device: str = "cpu", *,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 follower_bands: BandHandlerFactory | None = None,
                 cpu_threads: int = 0) -> None:
        if world_size < 1:
            raise ValueError(f"a group needs at least one rank, got {world_size}")
        self.world_size = world_size
        self.devices = rank_devices(device, world_size)
        self.timeout_s = timeout_s
        self.follower_bands = follower_bands
        self.cpu_threads = cpu_threads
        self.processes: list[multiprocessing.Process] = []
        self.tp: TensorParallelGroup | None = None
        self.broken = False  # set by mark_broken
        self._restore = None  # how to put this process's threads or device back

    @property
    def device(self) -> str:
        """Rank 0's device."""
        return self.devices[0]

    def __enter__(self) -> TensorParallelGroup:
        if self.world_size == 1:
            self.tp = TensorParallelGroup.single()
            return self.tp
        self._become_rank_zero()
        store = leader_store(self.world_size, timeout_s=self.timeout_s)
        context = multiprocessing.get_context("spawn")  # fork would copy torch's threads
        for rank in range(1, self.world_size):
            process = context.Process(
                target=_follow, name=f"flashsplit-tp-rank{rank}", daemon=True,
                args=(rank, self.world_size, store.port, self.devices[rank], self.timeout_s,
                      self.follower_bands, self.cpu_threads))
            process.start()
            self.processes.append(process)
        try:
            self._wait_for_followers(store)
            self.tp = connect(0, self.world_size, store=store, device=self.device,
                              timeout_s=self.timeout_s)
        except BaseException:
            self._end_followers()
            self._restore()
            raise
        return self.tp

    def _become_rank_zero(self) -> None:
        import torch

        if self.device == "cpu":
            threads = torch.get_num_threads()
            # the ranks share the host's cores (see _follow)
            torch.set_num_threads(cpu_threads_per_rank(self.world_size, self.cpu_threads))
            self._restore = lambda: torch.set_num_threads(threads)
        else:
            current = torch.cuda.current_device()
            torch.cuda.set_device(self.device)  # rank 0's collectives run on its own GPU
            self._restore = lambda: torch.cuda.set_device(current)

    def _wait_for_followers(self, store) -> None:
        """Until every follower has started; a follower that exits first is an error now,
        not a rendezvous that waits out its timeout."""
        keys = [f"{STARTED_KEY}{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                raise RuntimeError(f"tensor-parallel follower {dead[0].name} exited with code "
                                   f"{dead[0].exitcode} before it joined the group")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the followers did not start within {self.timeout_s} s")
            time.sleep(POLL_S)

    def mark_broken(self) -> None:
        """Rank 0 can no longer meet the followers in a collective (its engine stopped on an
        error, or may still be inside a step): on leaving, they are ended, not told to stop."""
        self.broken = True

    def __exit__(self, exc_type, *exc) -> None:
        if self.tp is not None and self.tp.world_size > 1:
            # leaving on an error, the followers may be inside a collective that rank 0 will
            # never join: a Stop would not reach them, so they are ended instead
            if (exc_type is None and not self.broken
                    and all(p.is_alive() for p in self.processes)):
                try:
                    FollowerLink(self.tp).stop()
                except RuntimeError:  # a follower went away while being told
                    log.warning("a follower left before it was told to stop")
                self._end_followers()
            else:
                self._end_followers(wait_s=0.0)
            self._restore()
        self.tp = None

    def _end_followers(self, wait_s: float = JOIN_TIMEOUT_S) -> None:
        for p in self.processes:
            p.join(wait_s)
            if p.is_alive():
                log.warning("follower %s did not stop; ending it", p.name)
                p.terminate()
                p.join()
        self.processes = []
