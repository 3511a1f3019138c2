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


def _mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _without_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
@pytest.mark.parametrize("model", ["pycoder", "tiny"])
def test_a_serving_router_has_not_loaded_torch(model):
    env = {**_without_token(), TOKEN_ENV: "t" * 32}
    # workers that are not there: the router serves (and reports them down) all the same
    router = subprocess.Popen(
        [sys.executable, "-m", "router", "--model", model, "--prefill", "127.0.0.1:1",
         "--decode", "127.0.0.1:2", "--port", "0", "--http-port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in router.stdout:
            if "listening on" in line:
                break
        else:
            pytest.fail(f"the router did not start: {router.stderr.read()[-2000:]}")
        maps = _mapped_libraries(router.pid)
        assert "libtorch" not in maps and "/torch/" not in maps
        assert "libpython" in maps or "python" in maps  # the map is the router's own
    finally:
        router.terminate()
        router.wait(timeout=30)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_the_process_of_up_has_not_loaded_torch():
    up = subprocess.Popen([sys.executable, "-m", "router.cli", "up", "--quiet", "--port", "0",
                           "--model", "pycoder", *FAKE_WORKERS], cwd=ROOT, env=_without_token(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in up.stdout:
            if "router listening" in line:
                break
        else:
            pytest.fail(f"the cluster did not start: {up.stderr.read()[-2000:]}")
        maps = _mapped_libraries(up.pid)
        assert "libtorch" not in maps and "/torch/" not in maps
    finally:
        up.terminate()
        up.wait(timeout=60)
