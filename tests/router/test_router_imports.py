"""The router process and `flashsplit up`'s supervising process run without torch: they read the
model's config and tokenizer, never its weights, and torch would cost each about 2.5 s of
start-up and 200 MB (`up` parses its flags before any worker starts, and starts the router
after its workers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.security import TOKEN_ENV, TOKEN_FILE_ENV

ROOT = Path(__file__).resolve().parents[2]
FAKE_WORKERS = ("--prefill-module", "tests.router.fake_prefill",
                "--decode-module", "tests.router.fake_decode")

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(),
                                reason="reads /proc/<pid>/maps")


def _without_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}


def _assert_serves_without_torch(args: list[str], env: dict[str, str], ready: str) -> None:
    """Start ``python args``, wait for a stdout line with ``ready``, and read its memory map."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if ready in line:
                break
        else:
            pytest.fail(f"{args[:2]} did not start: {proc.stderr.read()[-2000:]}")
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "python" in maps  # the map is a live process's
        assert "libtorch" not in maps and "/torch/" not in maps
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("model", ["pycoder", "tiny"])
def test_a_serving_router_has_not_loaded_torch(model):
    # workers that are not there: the router serves (and reports them down) all the same
    _assert_serves_without_torch(
        ["-m", "router", "--model", model, "--prefill", "127.0.0.1:1", "--decode",
         "127.0.0.1:2", "--port", "0", "--http-port", "0"],
        {**_without_token(), TOKEN_ENV: "t" * 32}, "listening on")


def test_the_process_of_up_has_not_loaded_torch():
    _assert_serves_without_torch(
        ["-m", "router.cli", "up", "--quiet", "--port", "0", "--model", "pycoder",
         *FAKE_WORKERS], _without_token(), "router listening")
