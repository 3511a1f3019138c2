"""Start and stop a local cluster: N prefill workers, M decode workers and a router, as processes.

``with Cluster(ClusterConfig(...)) as c:`` returns once the router serves; ``c.router_address`` is
where to send requests and ``c.workers`` lists the worker processes (tests kill them to inject
faults). Every process announces readiness with one stdout line ``<prog> listening on HOST:PORT``
(after ``<prog> metrics on HOST:PORT`` when it serves metrics on a port of its own);
its stderr is kept (the last lines) so that a process that dies during start-up can be reported
with its own error. On exit the router is stopped first, so that no request is sent to a worker
that is already going away, then the workers: SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from common.auth import new_secret
from common.channels import ChannelSecurity, make_channel
from common.cpu_threads import available_cpus
from common.grpc_util import bind_problem
from common.lifecycle import PARENT_PID_ENV
from common.logging_setup import echo_line
from common.mps import MpsDaemon, MpsUnavailable
from common.security import TOKEN_ENV, TOKEN_FILE_ENV
from router.cpu_shares import cpu_thread_shares
from router.device_plan import worker_devices
from router.memory_shares import memory_shares

_LISTENING = re.compile(r"^(\S+) listening on (\S+:\d+)\s*$")
# the router's HTTP API (--http-port), announced before its ready line
_HTTP_LISTENING = re.compile(r"^\S+ serves OpenAI HTTP on https?://(\S+:\d+)\s*$")
# a process's Prometheus endpoint (--metrics-port), announced before its ready line
_METRICS_LISTENING = re.compile(r"^\S+ metrics on (\S+:\d+)\s*$")
# The directory holding the router package, so children import this checkout's code.
_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)


class ClusterError(RuntimeError):
    """A process failed to start; the message names it and ends with its stderr tail."""


@dataclass(frozen=True)
class ClusterConfig:
    """What to start. worker_args go to every worker (--dtype, --page-size, ...).

    devices, when given, are assigned to the workers in order (prefill workers first), cycling,
    so ``("cuda:0", "cuda:1")`` puts one prefill and one decode worker on separate GPUs; with
    tensor-parallel workers, one per rank of all workers gives each worker GPUs of its own
    (``router/device_plan.py``).
    """

    model: str = "tiny"
    host: str = "127.0.0.1"
    router_port: int = 0
    num_prefill: int = 1
    num_decode: int = 1
    # each prefill (decode) worker's --tp: it shards the model over that many processes,
    # which it starts itself; the two sizes need not be equal
    prefill_tp: int = 1
    decode_tp: int = 1
    worker_args: tuple[str, ...] = ()
    # after worker_args, to one kind only (a later flag wins): e.g. a transport per side
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    # --mem-fraction of each device, split evenly between the workers on it (memory_shares);
    # CPU workers not given --cpu-threads always get an even share of the host's CPUs
    # (router/cpu_shares.py)
    mem_fraction: float | None = None
    router_args: tuple[str, ...] = ()
    # the router's OpenAI-compatible HTTP API: None = not served, 0 = any free port
    router_http_port: int | None = None
    # Modules run with ``python -m``; tests substitute fake workers that speak the same protocol.
    prefill_module: str = "prefill_service"
    decode_module: str = "decode_service"
    router_module: str = "router"
    start_timeout_s: float = 600.0
    stop_grace_s: float = 10.0
    # --grace of every process (None: their default); stop() then waits at least that long,
    # plus a margin, before it kills one
    grace_s: float | None = None
    # the router polls a down worker at least this often, so that one restarted on its address
    # (router/supervisor.py) is back in rotation within seconds
    worker_backoff_max_s: float = 2.0
    echo_logs: bool = False
    # every process serves Prometheus metrics on a free port (--metrics-port 0); the router
    # only when it has no HTTP API, whose /metrics serves them
    metrics: bool = False
    # --log-format of every process (None: their default); echoed logs keep to it
    log_format: str | None = None
    stderr_tail_lines: int = 40
    # the internal token every process gets; None: a new random one for each Cluster
    internal_token: str | None = field(default=None, repr=False)
    # the workers run as clients of a CUDA MPS daemon of the cluster's own (common/mps.py),
    # so that workers on one GPU run their kernels side by side instead of time-slicing it
    mps: bool = False

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode worker")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("a worker's tensor-parallel size must be at least 1")
        self.worker_devices()  # raises ValueError for devices that do not fit the workers

    def worker_devices(self) -> list[str | None]:
        """Each worker's ``--device`` (None: none given), prefill workers first."""
        return worker_devices(self.devices, [self.prefill_tp] * self.num_prefill
                              + [self.decode_tp] * self.num_decode)


@dataclass
class ManagedProcess:
    """One child process: its role, name, address once ready, and the Popen."""

    kind: str            # "prefill", "decode" or "router"
    name: str            # e.g. "prefill-0"
    popen: subprocess.Popen
    address: str = ""
    http_address: str = ""  # the router's HTTP API, when it serves one
    metrics_address: str = ""  # its Prometheus endpoint, when on a port of its own
    args: tuple[str, ...] = ()  # what it was started with, after the interpreter
    _ready: threading.Event = field(default_factory=threading.Event, repr=False)
    _stderr: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200),
                                       repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def ready(self) -> bool:
        """Whether it has printed its ready line."""
        return self._ready.is_set()

    @property
    def scheme(self) -> str:
        """Of its HTTP endpoints (metrics, the router's API): https when it was given a
        certificate, as they serve TLS with it then."""
        return "https" if "--tls-cert" in self.args else "http"

    @property
    def metrics_url(self) -> str:
        """Where its Prometheus metrics are scraped ("" where it serves none): its metrics
        port, else the router's HTTP API."""
        address = self.metrics_address or self.http_address
        return f"{self.scheme}://{address}/metrics" if address else ""

    def stderr_tail(self, lines: int = 40) -> str:
        return "\n".join(list(self._stderr)[-lines:])


def _pump(stream: TextIO, proc: ManagedProcess, is_stdout: bool, echo: bool,
          log_format: str = "text") -> None:
    """Read a child's output until it closes; spot the ready line, keep the stderr tail.

    NOTE: both pipes must be drained for the child's whole life, or it blocks once a pipe
    buffer fills.
    """
    for line in stream:
        line = line.rstrip("\n")
        if is_stdout and not proc._ready.is_set():
            m = _HTTP_LISTENING.match(line)
            if m:
                proc.http_address = m.group(1)
                continue
            m = _METRICS_LISTENING.match(line)
            if m:
                proc.metrics_address = m.group(1)
                continue
            m = _LISTENING.match(line)
            if m:
                proc.address = m.group(2)
                proc._ready.set()
                continue
        if not is_stdout:
            proc._stderr.append(line)
        if echo:
            print(echo_line(proc.name, line, log_format), file=sys.stderr, flush=True)


class Cluster:
    """Context manager over the processes of one local cluster."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.internal_token = config.internal_token or new_secret()
        self.workers: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None
        self._mps: MpsDaemon | None = None

    @property
    def router_address(self) -> str:
        if self.router is None:
            raise RuntimeError("the cluster is not started")
        return self.router.address

    @property
    def http_url(self) -> str:
        """``http(s)://host:port`` of the router's HTTP API (``router_http_port`` set)."""
        if self.router is None or not self.router.http_address:
            raise RuntimeError("the cluster's router serves no HTTP API")
        return f"{self.router.scheme}://{self.router.http_address}"

    def worker_channel(self, address: str):
        """A channel to one of this cluster's workers that carries its internal token."""
        return make_channel(address, ChannelSecurity.internal(self.internal_token))

    def _spawn(self, kind: str, name: str, args: list[str]) -> ManagedProcess:
        env = dict(os.environ)
        # the token goes in the environment, which only this user can read, not on the command
        # line, which `ps` shows everyone; an inherited token file would override it
        env[TOKEN_ENV] = self.internal_token
        env.pop(TOKEN_FILE_ENV, None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_SOURCE_ROOT, env.get("PYTHONPATH"))
                                            if p)
        env["PYTHONUNBUFFERED"] = "1"
        if self._mps is not None:
            env.update(self._mps.env)
        # the child ends with this process (common/lifecycle.py): no preexec_fn, which would run
        # Python between fork and exec, where gRPC's threads make the child crash
        env[PARENT_PID_ENV] = str(os.getpid())
        popen = subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, bufsize=1, env=env,
            # NOTE: a session of their own keeps a terminal's Ctrl-C from reaching the children
            # directly; the cluster forwards it in order (router first).
            start_new_session=True)
        proc = ManagedProcess(kind, name, popen, args=tuple(args))
        for stream, is_stdout in ((popen.stdout, True), (popen.stderr, False)):
            threading.Thread(target=_pump, args=(stream, proc, is_stdout, self.config.echo_logs,
                                                 self.config.log_format or "text"),
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
        problem = bind_problem(c.host, c.router_port) if c.router_port else None
        if problem is not None:
            # fail before loading any model; the router's own bind still decides in the end
            raise ClusterError(f"cannot listen on {c.host}:{c.router_port}: {problem}")
        kinds = ["prefill"] * c.num_prefill + ["decode"] * c.num_decode
        counts: dict[str, int] = collections.Counter()
        planned: list[tuple[str, list[str]]] = []
        devices = c.worker_devices()
        try:
            if c.mps:
                self._mps = MpsDaemon(Path(tempfile.mkdtemp(prefix="flashsplit-mps-")))
                try:
                    self._mps.start()
                except MpsUnavailable as exc:
                    raise ClusterError(f"--mps: {exc}") from exc
            for i, kind in enumerate(kinds):
                module = c.prefill_module if kind == "prefill" else c.decode_module
                tp = c.prefill_tp if kind == "prefill" else c.decode_tp
                args = ["-m", module, "--host", c.host, "--port", "0", "--model", c.model,
                        *(["--tp", str(tp)] if tp > 1 else []), *c.worker_args,
                        *(c.prefill_args if kind == "prefill" else c.decode_args),
                        *self._grace_args(), *self._log_args(),
                        *(["--metrics-port", "0"] if c.metrics else [])]
                if devices[i] is not None:
                    args += ["--device", devices[i]]
                planned.append((kind, args))
            shares = [None] * len(planned) if c.mem_fraction is None \
                else memory_shares([args for _, args in planned], c.mem_fraction)
            threads = cpu_thread_shares([args for _, args in planned], available_cpus())
            for (kind, args), share, cpu_threads in zip(planned, shares, threads):
                if share is not None:
                    args += ["--mem-fraction", f"{share:g}"]
                if cpu_threads is not None:
                    args += ["--cpu-threads", str(cpu_threads)]
                self.workers.append(self._spawn(kind, f"{kind}-{counts[kind]}", args))
                counts[kind] += 1
            self._wait_ready(self.workers)
            args = ["-m", c.router_module, "--host", c.host, "--port", str(c.router_port),
                    "--model", c.model, "--worker-backoff-max", str(c.worker_backoff_max_s),
                    *self._grace_args(), *self._log_args(), *c.router_args]
            if c.router_http_port is not None:
                args += ["--http-port", str(c.router_http_port)]
            elif c.metrics:
                args += ["--metrics-port", "0"]
            for w in self.workers:
                args += [f"--{w.kind}", w.address]
            self.router = self._spawn("router", "router", args)
            self._wait_ready([self.router])
        except BaseException:
            self.stop()
            raise
        return self

    def _grace_args(self) -> list[str]:
        return [] if self.config.grace_s is None else ["--grace", str(self.config.grace_s)]

    def _log_args(self) -> list[str]:
        fmt = self.config.log_format
        return [] if fmt is None else ["--log-format", fmt]

    def respawn(self, index: int) -> ManagedProcess:
        """Start worker ``index`` again, with its arguments, on the port it had, and put the new
        process in its place in ``workers``; returns it without waiting for it to be ready.

        The same port keeps the router's worker list valid: the router polls the address, and
        takes the worker back once it answers. The old process must have exited.
        """
        old = self.workers[index]
        if old.alive():
            raise RuntimeError(f"{old.name} (pid {old.pid}) is still running")
        args = list(old.args)
        port = old.address.rsplit(":", 1)[1] if old.address else "0"
        args[args.index("--port") + 1] = port
        if "--metrics-port" in args and old.metrics_address:
            # scrapers keep finding it where they did (the last flag is the one in force)
            last = len(args) - 1 - args[::-1].index("--metrics-port")
            args[last + 1] = old.metrics_address.rsplit(":", 1)[1]
        proc = self._spawn(old.kind, old.name, args)
        proc.address = old.address  # until its ready line says where it listens
        proc.metrics_address = old.metrics_address
        self.workers[index] = proc
        return proc

    def stop(self) -> None:
        """Stop the router, then the workers; SIGKILL whatever outlives the grace period."""
        kill_after = self.config.stop_grace_s
        if self.config.grace_s is not None:
            # the processes end their last calls shortly after their own grace
            kill_after = max(kill_after, self.config.grace_s + 5.0)
        if self.router is not None:
            _terminate([self.router], kill_after)
        _terminate(self.workers, kill_after)
        if self._mps is not None:  # its quit waits for the workers, its clients, to end
            mps, self._mps = self._mps, None
            mps.stop()
            shutil.rmtree(mps.directory, ignore_errors=True)

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
