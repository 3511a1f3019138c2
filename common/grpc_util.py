"""gRPC plumbing every service shares: server options, health, serving until a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

# Handoff chunks are <= 1 MiB; leave room for headers and a generous manifest.
MAX_MESSAGE_BYTES = 16 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.http2.min_ping_interval_without_data_ms", 5_000)]


def make_server() -> tuple[grpc.aio.Server, health.HealthServicer]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


async def set_serving(health_servicer, service_names: list[str], serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


def bind(server: grpc.aio.Server, host: str, port: int) -> str:
    """Bind an insecure port (0 = any free one) and return ``host:port`` actually bound."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return f"{host}:{bound}"


async def serve_until_signal(server: grpc.aio.Server, health_servicer, service_names: list[str],
                             announce: str, on_stop: Callable[[], Awaitable[None]] | None = None,
                             grace: float = 5.0) -> None:
    """Start, report SERVING, print ``announce`` (the line process managers wait for), and run
    until SIGINT/SIGTERM; then drain gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    await set_serving(health_servicer, service_names, True)
    print(announce, flush=True)
    sys.stdout.flush()
    await stop.wait()
    log.info("shutting down")
    await health_servicer.enter_graceful_shutdown()
    if on_stop is not None:
        await on_stop()
    await server.stop(grace)


async def abort_if_engine_stopped(engine, context) -> None:
    """End a call with UNAVAILABLE when the worker's engine thread has died: the router takes
    the worker out until it answers again."""
    if not engine.is_alive:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine stopped: {engine.error!r}")

