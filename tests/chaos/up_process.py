"""``flashsplit up`` as a child process, for tests that kill and signal its parts.

``UpProcess`` starts the command, keeps every line it prints (stdout and stderr, with the time
each arrived), and knows the router's address and each worker's pid from the lines ``up``
prints once it serves. Loads are read from the router's public ``ListWorkers`` (the load
reports it polls), so no internal token is needed. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc
from common.sampling import SamplingParams
from router.remote import Completion, generate, request_to_pb

_WORKER_LINE = re.compile(r"^(\S+) on (\S+:\d+) \(pid (\d+)\)$")


@dataclass
class UpProcess:
    """A running ``flashsplit up``; ``args`` are its flags after ``up``."""

    args: tuple[str, ...]
    start_timeout_s: float = 60.0
    lines: list[tuple[float, str]] = field(default_factory=list)
    router_address: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", "router.cli", "up", *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            with self._lock:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    def output(self) -> str:
        with self._lock:
            return "\n".join(line for _, line in self.lines)

    def _find(self, regex: re.Pattern, after: float) -> tuple[float, str] | None:
        with self._lock:
            return next(((at, line) for at, line in self.lines
                         if at >= after and regex.search(line)), None)

    def wait_for_line(self, pattern: str, timeout_s: float, after: float = 0.0) -> float:
        """The arrival time of the first line after ``after`` matching ``pattern``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            found = self._find(regex, after)
            if found is not None:
                return found[0]
            exited = self.proc.poll() is not None
            if exited or time.monotonic() > deadline:
                time.sleep(0.2)  # the last lines of an exited process
                found = self._find(regex, after)
                if found is not None:
                    return found[0]
                raise AssertionError(
                    f"no line matching {pattern!r} within {timeout_s} s (up "
                    f"{'exited' if exited else 'still running'}); output:\n"
                    f"{self.output()[-4000:]}")
            time.sleep(0.05)

    def start(self, workers: int) -> UpProcess:
        """Wait until the router and ``workers`` workers are announced."""
        self.wait_for_line(r"^router listening on ", self.start_timeout_s)
        deadline = time.monotonic() + 10
        while len(self.pids) < workers and time.monotonic() < deadline:
            with self._lock:
                for _, line in self.lines:
                    if line.startswith("router listening on "):
                        self.router_address = line.split()[-1]
                    m = _WORKER_LINE.match(line)
                    if m:
                        self.addresses[m.group(1)] = m.group(2)
                        self.pids[m.group(1)] = int(m.group(3))
            time.sleep(0.05)
        assert len(self.pids) == workers, self.output()
        return self

    def note_restart(self, name: str, after: float, timeout_s: float = 30.0) -> int:
        """Wait for ``name``'s restart line after time ``after``; returns its new pid."""
        regex = re.compile(rf"^restarted {re.escape(name)} on \S+ \(pid (\d+)\)$")
        self.wait_for_line(regex.pattern, timeout_s, after)
        _, line = self._find(regex, after)
        self.pids[name] = int(regex.match(line).group(1))
        return self.pids[name]

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its children get SIGTERM from the kernel (PDEATHSIG)
            self.proc.wait()
            raise


async def list_workers(address: str) -> list[generation_pb2.WorkerInfo]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await generation_pb2_grpc.GenerationStub(channel).ListWorkers(
            generation_pb2.ListWorkersRequest(), timeout=5)
    return list(reply.workers)


def wait_pools_free(address: str, timeout_s: float = 15.0) -> dict[str, tuple[int, int]]:
    """Wait until every worker is healthy and reports all pages and slots free (as the router
    last polled them); returns ``{address: (free_pages, free_slots)}``."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = asyncio.run(list_workers(address))
        free = {w.address: (w.load.free_pages, w.load.free_slots) for w in workers}
        if all(w.healthy and w.load.total_pages > 0 and w.load.free_pages == w.load.total_pages
               and w.load.free_slots == w.load.total_slots for w in workers):
            return free
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not free within {timeout_s} s: {workers}")
        time.sleep(0.1)


def generate_until_served(address: str, prompts: list[list[int]], params: SamplingParams,
                          timeout_s: float = 20.0) -> list[Completion]:
    """Run ``prompts`` (concurrently), retrying the whole set while the cluster still answers
    UNAVAILABLE (a restarted worker not yet back in rotation)."""
    deadline = time.monotonic() + timeout_s

    async def all_of_them():
        return await asyncio.gather(*[
            generate(address, request_to_pb(token_ids=p, params=params), timeout_s=30)
            for p in prompts])

    while True:
        try:
            return asyncio.run(all_of_them())
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
