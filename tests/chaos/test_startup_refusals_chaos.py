"""Start-up refuses what it cannot do safely: a port in use, or internal RPCs with no token.

Real processes on 127.0.0.1. gRPC's default (SO_REUSEPORT) would let a second server bind a port
in use and silently share its connections; each service and `flashsplit up` must instead exit
non-zero with a message naming the port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.auth import new_secret
from common.security import TOKEN_ENV, TOKEN_FILE_ENV

ROOT = Path(__file__).resolve().parents[2]
FAKES = ("--model", "tiny", "--prefill-module", "tests.router.fake_prefill",
         "--decode-module", "tests.router.fake_decode")


def env(token: str | None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    if token is not None:
        out[TOKEN_ENV] = token
    return out


def run(*args: str, token: str | None = "t" * 32, timeout_s: float = 90):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env(token),
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture
def taken_port():
    """A port something is already listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("service", [
    ("-m", "prefill_service", "--model", "tiny"),
    ("-m", "decode_service", "--model", "tiny"),
    ("-m", "router", "--model", "tiny", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"),
], ids=["prefill", "decode", "router"])
def test_each_service_exits_on_a_port_in_use(service, taken_port):
    done = run(*service, "--port", str(taken_port))
    assert done.returncode == 1, done.stderr
    assert f"error: cannot listen on 127.0.0.1:{taken_port}: Address already in use" \
        in done.stderr
    assert "listening on" not in done.stdout


def test_a_second_up_on_the_same_port_fails_and_the_first_keeps_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = subprocess.Popen([sys.executable, "-m", "router.cli", "up", "--quiet", "--port",
                              str(port), *FAKES], cwd=ROOT, env=env(None),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()
        assert line.strip() == f"router listening on 127.0.0.1:{port}", first.stderr.read()
        second = run("-m", "router.cli", "up", "--quiet", "--port", str(port), *FAKES,
                     token=None, timeout_s=60)
        assert second.returncode == 1
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in second.stderr
        assert "router listening" not in second.stdout
        assert first.poll() is None  # the first cluster was not disturbed
    finally:
        first.terminate()
        try:
            first.wait(timeout=30)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()


@pytest.mark.parametrize("module", ["prefill_service", "decode_service"])
def test_a_worker_with_no_token_refuses_to_start_unless_told_to_run_open(module, tmp_path):
    done = run("-m", module, "--model", "tiny", token=None, timeout_s=60)
    assert done.returncode == 2
    assert "no internal token" in done.stderr and "--insecure-no-auth" in done.stderr
    # a token file that is not one is a clear error too
    (tmp_path / "token").write_text("short\n")
    done = run("-m", module, "--model", "tiny", "--internal-token-file",
               str(tmp_path / "token"), token=None, timeout_s=60)
    assert done.returncode == 2 and "at least 16 characters" in done.stderr


def test_the_token_never_appears_on_a_command_line():
    """`flashsplit up` hands its generated token over in the environment only."""
    from router.cluster import Cluster, ClusterConfig

    token = new_secret()
    config = ClusterConfig(prefill_module="tests.router.fake_prefill",
                           decode_module="tests.router.fake_decode", start_timeout_s=60,
                           internal_token=token)
    with Cluster(config) as cluster:
        for proc in [*cluster.workers, cluster.router]:
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().decode()
            assert token not in cmdline
            assert f"{TOKEN_ENV}={token}" in environ.split("\0")
