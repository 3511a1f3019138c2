"""Keep a local cluster's workers running: restart one that exits or stops serving, with backoff.

``flashsplit up`` runs ``Supervisor.run`` over its ``Cluster`` until SIGINT/SIGTERM. Every
``probe_interval_s`` each worker is looked at:

- exited (SIGKILL, a crash, a worker whose engine thread died exits non-zero on its own) ->
  restarted;
- its ``grpc.health.v1`` says NOT_SERVING for longer than ``not_serving_after_s`` without it
  exiting, or it has not answered a health check for ``unresponsive_after_s`` (hung) -> killed
  and restarted.

A worker is restarted with its own arguments on the port it had (``Cluster.respawn``), so the
router, which polls that address, takes it back into rotation as soon as it answers. Restarts
of one worker back off exponentially (``backoff_initial_s`` doubling up to ``backoff_max_s``);
a worker that stayed up ``stable_after_s`` starts afresh. Each failure and each restart is
printed. A router that exits ends the run with status 1: without it the cluster serves nothing.

Health checks need no token (``common/auth.py`` leaves health open), so a probe that is refused
for any other reason than being unreachable still counts as an answer.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.cluster import Cluster, ManagedProcess

_NO_ANSWER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass(frozen=True)
class SupervisorConfig:
    """How workers are watched and how often a failing one is restarted, in seconds."""

    probe_interval_s: float = 0.5
    probe_timeout_s: float = 1.0
    # a worker says NOT_SERVING while it drains for a shutdown and when its engine died; either
    # way it exits by itself soon after, so this only catches one that does not
    not_serving_after_s: float = 15.0
    unresponsive_after_s: float = 15.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0

    def __post_init__(self) -> None:
        if min(self.probe_interval_s, self.probe_timeout_s, self.backoff_initial_s) <= 0:
            raise ValueError("probe_interval_s, probe_timeout_s and backoff_initial_s must be > 0")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")


def restart_delay(config: SupervisorConfig, failures: int) -> float:
    """Seconds before the restart that follows a worker's n-th failure in a row."""
    return min(config.backoff_max_s, config.backoff_initial_s * 2 ** (max(failures, 1) - 1))


@dataclass
class _Watch:
    """What the supervisor knows of one worker slot (index into ``Cluster.workers``)."""

    started_at: float
    last_answer: float
    failures: int = 0
    restarts: int = 0
    not_serving_since: float | None = None
    restart_at: float | None = None  # set while it waits out its backoff
    starting: bool = False  # respawned, not ready yet


class Supervisor:
    """Watches ``cluster``'s workers and restarts them; see the module docstring."""

    def __init__(self, cluster: Cluster, config: SupervisorConfig = SupervisorConfig(), *,
                 out: TextIO = sys.stderr, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.config = config
        self.out = out
        self.clock = clock
        now = clock()
        self._watches = [_Watch(started_at=now, last_answer=now) for _ in cluster.workers]
        self._channels: dict[str, grpc.aio.Channel] = {}

    @property
    def restarts(self) -> int:
        """Restarts done so far, all workers together."""
        return sum(w.restarts for w in self._watches)

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    async def run(self, stop: threading.Event) -> int:
        """Supervise until ``stop`` is set (0) or the router exits (1)."""
        try:
            while not stop.is_set():
                router = self.cluster.router
                if router is not None and not router.alive():
                    self._say(f"error: the router exited with status {router.popen.returncode}")
                    return 1
                await self.tick()
                await asyncio.sleep(self.config.probe_interval_s)
            return 0
        finally:
            channels, self._channels = list(self._channels.values()), {}
            await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)

    async def tick(self) -> None:
        """Look at every worker once: probe the running ones, restart those due."""
        now = self.clock()
        probes = []
        for index, watch in enumerate(self._watches):
            proc = self.cluster.workers[index]
            if watch.restart_at is not None:
                if now >= watch.restart_at:
                    self._respawn(index, watch, now)
            elif watch.starting:
                await self._check_start(index, watch, proc, now)
            elif not proc.alive():
                self._failed(index, watch, f"exited with status {proc.popen.returncode}", now)
            else:
                probes.append(self._probe(index, watch, proc))
        await asyncio.gather(*probes)

    def _respawn(self, index: int, watch: _Watch, now: float) -> None:
        proc = self.cluster.respawn(index)
        watch.restart_at, watch.starting = None, True
        watch.started_at = watch.last_answer = now
        watch.not_serving_since = None
        watch.restarts += 1
        self._say(f"restarting {proc.name} on {proc.address} (pid {proc.pid})")

    async def _check_start(self, index: int, watch: _Watch, proc: ManagedProcess,
                           now: float) -> None:
        if proc.ready():
            watch.starting = False
            watch.last_answer = now
            self._say(f"restarted {proc.name} on {proc.address} (pid {proc.pid})")
        elif not proc.alive():
            self._failed(index, watch, f"exited with status {proc.popen.returncode} before it "
                                       f"was ready", now)
        elif now - watch.started_at > self.cluster.config.start_timeout_s:
            await self._kill(proc)
            self._failed(index, watch, f"was not ready within "
                                       f"{self.cluster.config.start_timeout_s:.0f} s", now)

    async def _probe(self, index: int, watch: _Watch, proc: ManagedProcess) -> None:
        status = await self._health(proc.address)
        now = self.clock()
        if status is not None:
            watch.last_answer = now
            if status == health_pb2.HealthCheckResponse.SERVING:
                watch.not_serving_since = None
            elif watch.not_serving_since is None:
                watch.not_serving_since = now
        c = self.config
        if watch.not_serving_since is not None and \
                now - watch.not_serving_since > c.not_serving_after_s:
            await self._kill(proc)
            self._failed(index, watch, f"reported NOT_SERVING for {c.not_serving_after_s:.0f} s "
                                       f"without exiting", now)
        elif now - watch.last_answer > c.unresponsive_after_s:
            await self._kill(proc)
            self._failed(index, watch, f"answered no health check for "
                                       f"{c.unresponsive_after_s:.0f} s", now)

    async def _health(self, address: str) -> int | None:
        """The worker's serving status; None when it did not answer at all."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.cluster.worker_channel(address)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.config.probe_timeout_s)
        except grpc.aio.AioRpcError as exc:
            # e.g. UNIMPLEMENTED from a worker without a health service: it answered
            return None if exc.code() in _NO_ANSWER else health_pb2.HealthCheckResponse.SERVING
        return reply.status

    async def _kill(self, proc: ManagedProcess) -> None:
        if proc.alive():
            proc.popen.kill()
        await asyncio.to_thread(proc.popen.wait)

    def _failed(self, index: int, watch: _Watch, reason: str, now: float) -> None:
        if now - watch.started_at >= self.config.stable_after_s:
            watch.failures = 0  # it had been serving for a while: back off from the start
        watch.failures += 1
        watch.starting = False
        delay = restart_delay(self.config, watch.failures)
        watch.restart_at = now + delay
        proc = self.cluster.workers[index]
        self._say(f"warning: {proc.name} ({proc.address}) {reason}; restarting it in "
                  f"{delay:.1f} s")
