"""compose.yaml, run as it declares: the same commands, environment and health checks, with each
service as a local process and its ports mapped to 127.0.0.1 (no container engine runs here)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from common.auth import new_secret, write_secret_file
from common.channels import ChannelSecurity, make_channel
from common.engine.llm_engine import EngineConfig, LLMEngine
from common.model.load import load_model
from common.pb.flashsplit.v1 import prefill_pb2_grpc, types_pb2
from common.sampling import SamplingParams
from router.remote import generate, request_to_pb

ROOT = Path(__file__).resolve().parent.parent
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` substitution."""
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localize(args: list[str], services: list[str], secrets: dict[str, str]) -> list[str]:
    """Map the container network onto loopback: 0.0.0.0 and service hostnames -> 127.0.0.1;
    and compose secrets (/run/secrets/NAME) onto the local files in ``secrets``."""
    out = []
    for a in args:
        a = "127.0.0.1" if a == "0.0.0.0" else a
        for name in services:
            a = re.sub(rf"^{name}:(\d+)$", r"127.0.0.1:\1", a)
        for name, path in secrets.items():
            a = path if a == f"/run/secrets/{name}" else a
        out.append(a)
    return out


def executable(name: str) -> str:
    if name == "python":
        return sys.executable
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def wait_healthy(test: list[str], proc: subprocess.Popen, timeout_s: float = 120) -> None:
    cmd = [executable(test[1]), *test[2:]] if test[0] == "CMD" else test
    deadline = time.monotonic() + timeout_s
    while subprocess.run(cmd, cwd=ROOT, capture_output=True).returncode != 0:
        if proc.poll() is not None:
            raise AssertionError(f"{cmd} : service exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"health check {cmd} never passed")
        time.sleep(0.2)


def start_order(services: dict) -> list[str]:
    order: list[str] = []
    while len(order) < len(services):
        for name, svc in services.items():
            deps = svc.get("depends_on") or {}
            if name not in order and all(d in order for d in deps):
                order.append(name)
    return order


def test_compose_keeps_workers_private_and_gives_every_service_the_token():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert "internal_token" in compose["secrets"]
    for name in ("prefill", "decode"):
        # reachable on the compose network only: nothing of a worker is published on the host
        assert "ports" not in services[name], name
    assert services["router"]["ports"] == ["${ROUTER_PORT:-50051}:${ROUTER_PORT:-50051}"]
    for name, svc in services.items():
        assert "internal_token" in svc["secrets"], name
        cmd = svc["command"]
        i = cmd.index("--internal-token-file")
        assert cmd[i + 1] == "/run/secrets/internal_token", name
        assert "--insecure-no-auth" not in cmd, name


async def worker_load_code(address: str) -> grpc.StatusCode:
    async with make_channel(address) as channel:
        try:
            await prefill_pb2_grpc.PrefillStub(channel).GetLoad(types_pb2.LoadRequest(),
                                                                timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_compose_services_run_and_serve_a_request(tmp_path):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"router", "prefill", "decode"}
    for svc in services.values():
        assert svc["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "common.healthcheck"]
    gpu = services["decode"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert any(v.endswith(":/models:ro") for v in services["decode"]["volumes"])
    token_file = tmp_path / "internal-token"
    write_secret_file(token_file, new_secret())
    secrets = {"internal_token": str(token_file)}

    env = {"PREFILL_PORT": str(free_port()), "DECODE_PORT": str(free_port()),
           "ROUTER_PORT": str(free_port()), "MODEL": "tiny", "DEVICE": "cpu",
           "FLASHSPLIT_API_KEY": "sk-compose-test"}
    procs: list[subprocess.Popen] = []
    try:
        for name in start_order(services):
            svc = services[name]
            cmd = localize([interpolate(a, env) for a in svc["command"]], list(services),
                           secrets)
            service_env = {k: interpolate(str(v), env)
                           for k, v in (svc.get("environment") or {}).items()}
            proc = subprocess.Popen([executable(cmd[0]), *cmd[1:]], cwd=ROOT,
                                    env={**os.environ, **env, **service_env},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(proc)
            test = [interpolate(a, env) for a in svc["healthcheck"]["test"]]
            wait_healthy(test, proc)
        address = f"127.0.0.1:{env['ROUTER_PORT']}"
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        request = request_to_pb(token_ids=[1, 2, 3], params=params)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the router asks for the API key
            asyncio.run(generate(address, request))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out = asyncio.run(generate(address, request,
                                   security=ChannelSecurity.public("sk-compose-test")))
        local = LLMEngine(load_model("tiny"), EngineConfig()).generate([[1, 2, 3]], params)
        assert out.token_ids == local[0].output_ids
        # a worker answers no one without the token
        prefill = f"127.0.0.1:{env['PREFILL_PORT']}"
        assert asyncio.run(worker_load_code(prefill)) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
