"""common/grpc_util.serve_until_signal: a worker whose engine thread died says NOT_SERVING and
returns a non-zero status; SIGTERM stops it gracefully with status 0."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_util import ENGINE_STOPPED_EXIT, bind, make_server, serve_until_signal

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeEngine:
    """What the watcher reads of an EngineLoop."""

    def __init__(self) -> None:
        self.is_alive = True
        self.error: BaseException | None = None


async def serve_and_watch(stop_it) -> tuple[int, list[int]]:
    """Serve, watch health from a client, call ``stop_it()`` once SERVING was seen."""
    server, health = make_server()
    address = bind(server, "127.0.0.1", 0)
    engine = FakeEngine()
    serving = asyncio.ensure_future(serve_until_signal(
        server, health, ["test.Service"], f"test listening on {address}", grace=0.5,
        engine=engine, watch_interval_s=0.05))
    seen: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="test.Service"))
        try:
            async for msg in watch:
                seen.append(msg.status)
                if len(seen) == 1:
                    stop_it(engine)
        except grpc.aio.AioRpcError:
            pass  # the server stopped under the watch
    return await asyncio.wait_for(serving, 10), seen


def test_a_dead_engine_makes_the_worker_not_serving_and_exit_non_zero(capsys):
    def kill_engine(engine: FakeEngine) -> None:
        engine.error = RuntimeError("device lost")
        engine.is_alive = False

    status, seen = asyncio.run(asyncio.wait_for(serve_and_watch(kill_engine), 20))
    assert status == ENGINE_STOPPED_EXIT != 0
    assert seen[:2] == [SERVING, NOT_SERVING]
    assert "test listening on 127.0.0.1:" in capsys.readouterr().out


def test_sigterm_stops_it_gracefully_with_status_zero():
    def terminate(engine: FakeEngine) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler serve_until_signal installed

    status, seen = asyncio.run(asyncio.wait_for(serve_and_watch(terminate), 20))
    assert status == 0
    assert seen[:2] == [SERVING, NOT_SERVING]
