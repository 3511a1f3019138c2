"""Start and stop a local cluster: N prefill workers, M decode workers and a router, as processes.

``with Cluster(ClusterConfig(...)) as c:`` returns once the router serves; ``c.router_address`` is
where to send requests and ``c.workers`` lists the worker processes (tests kill them to inject
faults). Every process announces readiness with one stdout line ``<prog> listening on HOST:PORT``;
its stderr is kept (the last lines) so that a process that dies during start-up can be reported
with its own error. On exit the router is stopped first, so that no request is sent to a worker
that is already going away, then the workers: SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from common.lifecycle import PARENT_PID_ENV

_LISTENING = re.compile(r"^(\S+) listening on (\S+:\d+)\s*$")
# The directory holding the router package, so children import this checkout's code.
_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)


class ClusterError(RuntimeError):
    """A process failed to start; the message names it and ends with its stderr tail."""


@dataclass(frozen=True)
class ClusterConfig:
    """What to start. worker_args go to every worker (--dtype, --page-size, ...).

    devices, when given, are assigned to the workers in order (prefill workers first), cycling,
    so ``("cuda:0", "cuda:1")`` puts one prefill and one decode worker on separate GPUs.
    """

    model: str = "tiny"
    host: str = "127.0.0.1"
    router_port: int = 0
    num_prefill: int = 1
    num_decode: int = 1
    worker_args: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    # Modules run with ``python -m``; tests substitute fake workers that speak the same protocol.
    prefill_module: str = "prefill_service"
    decode_module: str = "decode_service"
    router_module: str = "router"
    start_timeout_s: float = 600.0
    stop_grace_s: float = 10.0
    echo_logs: bool = False
    stderr_tail_lines: int = 40

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode worker")


@dataclass
class ManagedProcess:
    """One child process: its role, name, address once ready, and the Popen."""

    kind: str            # "prefill", "decode" or "router"
    name: str            # e.g. "prefill-0"
    popen: subprocess.Popen
    address: str = ""
    _ready: threading.Event = field(default_factory=threading.Event, repr=False)
    _stderr: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200),
                                       repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stderr_tail(self, lines: int = 40) -> str:
        return "\n".join(list(self._stderr)[-lines:])


def _pump(stream: TextIO, proc: ManagedProcess, is_stdout: bool, echo: bool) -> None:
    """Read a child's output until it closes; spot the ready line, keep the stderr tail.

    NOTE: both pipes must be drained for the child's whole life, or it blocks once a pipe
    buffer fills.
    """
    for line in stream:
        line = line.rstrip("\n")
        if is_stdout and not proc._ready.is_set():
            m = _LISTENING.match(line)
            if m:
                proc.address = m.group(2)
                proc._ready.set()
                continue
        if not is_stdout:
            proc._stderr.append(line)
        if echo:
            print(f"[{proc.name}] {line}", file=sys.stderr, flush=True)


class Cluster:
    """Context manager over the processes of one local cluster."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.workers: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None

    @property
    def router_address(self) -> str:
        if self.router is None:
            raise RuntimeError("the cluster is not started")
        return self.router.address

    def _spawn(self, kind: str, name: str, args: list[str]) -> ManagedProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_SOURCE_ROOT, env.get("PYTHONPATH"))
                                            if p)
        env["PYTHONUNBUFFERED"] = "1"
        # the child ends with this process (common/lifecycle.py): no preexec_fn, which would run
        # Python between fork and exec, where gRPC's threads make the child crash
        env[PARENT_PID_ENV] = str(os.getpid())
        popen = subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, bufsize=1, env=env,
            # NOTE: a session of their own keeps a terminal's Ctrl-C from reaching the children
            # directly; the cluster forwards it in order (router first).
            start_new_session=True)
        proc = ManagedProcess(kind, name, popen)
        for stream, is_stdout in ((popen.stdout, True), (popen.stderr, False)):
            threading.Thread(target=_pump, args=(stream, proc, is_stdout, self.config.echo_logs),
                             name=f"{name}-{'out' if is_stdout else 'err'}",
                             daemon=True).start()
        return proc

    def _wait_ready(self, procs: list[ManagedProcess]) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        for proc in procs:
            while not proc._ready.wait(0.05):
                if not proc.alive():
                    proc.popen.wait()
                    time.sleep(0.1)  # let the pump threads take the last stderr lines
                    raise ClusterError(
                        f"{proc.name} exited with status {proc.popen.returncode} before it was "
                        f"ready; its last output:\n"
                        f"{proc.stderr_tail(self.config.stderr_tail_lines)}")
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"{proc.name} was not ready within {self.config.start_timeout_s} s; "
                        f"its last output:\n{proc.stderr_tail(self.config.stderr_tail_lines)}")

    def start(self) -> Cluster:
        c = self.config
        kinds = ["prefill"] * c.num_prefill + ["decode"] * c.num_decode
        counts: dict[str, int] = collections.Counter()
        try:
            for i, kind in enumerate(kinds):
                module = c.prefill_module if kind == "prefill" else c.decode_module
                args = ["-m", module, "--host", c.host, "--port", "0", "--model", c.model,
                        *c.worker_args]
                if c.devices:
                    args += ["--device", c.devices[i % len(c.devices)]]
                self.workers.append(self._spawn(kind, f"{kind}-{counts[kind]}", args))
                counts[kind] += 1
            self._wait_ready(self.workers)
            args = ["-m", c.router_module, "--host", c.host, "--port", str(c.router_port),
                    "--model", c.model, *c.router_args]
            for w in self.workers:
                args += [f"--{w.kind}", w.address]
            self.router = self._spawn("router", "router", args)
            self._wait_ready([self.router])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the router, then the workers; SIGKILL whatever outlives the grace period."""
        if self.router is not None:
            _terminate([self.router], self.config.stop_grace_s)
        _terminate(self.workers, self.config.stop_grace_s)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(procs: list[ManagedProcess], grace_s: float) -> None:
    for p in procs:
        if p.alive():
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
