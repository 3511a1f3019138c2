"""A CUDA MPS control daemon of our own, for processes that share one GPU (the prefill and
decode workers of ``flashsplit up`` on one device, or of ``benchmarks.ttft``).

Without MPS the GPU time-slices between processes: while one worker's kernels run, the other's
wait, whatever each leaves idle (a decode step reads weights while a prefill computes). Under
MPS their kernels run side by side, as streams of one process would. The daemon uses pipe and
log directories of its own, so only the processes given :attr:`MpsDaemon.env` join it and
nothing else on the machine does, and it is told to quit when its user stops. It changes no
setting of the device.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


class MpsUnavailable(RuntimeError):
    """The control program is not installed, or the daemon did not start."""


class MpsDaemon:
    """One daemon with its directories under ``directory``.

    Processes started with :attr:`env` in their environment are its clients. Its quit waits
    for every client to end, so :meth:`stop` comes after they have.
    """

    def __init__(self, directory: Path, *, timeout_s: float = 30.0) -> None:
        self.directory, self.timeout_s = Path(directory), timeout_s
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.directory / "mps-pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.directory / "mps-log")}
        self._control: str | None = None

    def start(self) -> None:
        """Raises MpsUnavailable when the control program is missing or fails."""
        control = shutil.which(CONTROL)
        if control is None:
            raise MpsUnavailable(f"{CONTROL} is not on PATH: MPS needs the driver's utilities")
        for d in self.env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        done = subprocess.run([control, "-d"], capture_output=True, text=True,
                              timeout=self.timeout_s, env={**os.environ, **self.env})
        if done.returncode != 0:
            raise MpsUnavailable(f"{CONTROL} -d failed ({done.returncode}): "
                                 f"{(done.stderr or done.stdout).strip()}")
        self._control = control

    def stop(self) -> None:
        """Tell the daemon to quit (a no-op when it was not started)."""
        if self._control is None:
            return
        control, self._control = self._control, None
        try:
            subprocess.run([control], input="quit\n", text=True, capture_output=True,
                           timeout=self.timeout_s, env={**os.environ, **self.env})
        except subprocess.TimeoutExpired:
            print(f"warning: the MPS daemon did not quit within {self.timeout_s:g} s (a client "
                  f"is still running)", file=sys.stderr)


@contextmanager
def mps_daemon(workdir: Path):
    """A started :class:`MpsDaemon` under ``workdir`` with this process's environment (and so
    that of the processes it starts) pointed at it, quit and the environment restored on exit.
    The CUDA work belongs in child processes: this process's own CUDA context would keep the
    quit waiting."""
    daemon = MpsDaemon(workdir)
    saved = {k: os.environ.get(k) for k in daemon.env}
    daemon.start()
    os.environ.update(daemon.env)
    try:
        yield daemon
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        daemon.stop()
