"""gRPC plumbing every service shares: server options, health, serving until a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from typing import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.request_guard import RequestGuard
from common.shutdown import GracefulShutdown, stop_gracefully

log = logging.getLogger(__name__)

# The exit status of a worker whose engine thread died (any non-zero status gets it replaced).
ENGINE_STOPPED_EXIT = 3

# Handoff chunks are <= 1 MiB; leave room for headers and a generous manifest.
MAX_MESSAGE_BYTES = 16 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's reconnect backoff grows to 2 minutes by default; a worker that `flashsplit up`
    # restarts on the same port must be reachable again within seconds
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC's default lets a second server bind a port in use and silently share it; a port in
    # use must be an error at start-up instead
    ("grpc.so_reuseport", 0),
]


def make_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                max_message_bytes: int | None = None
                ) -> tuple[grpc.aio.Server, health.HealthServicer]:
    """A server with our options and a health service; ``interceptors`` (authentication,
    ``common/auth.py``; graceful shutdown, ``common/shutdown.py``) see every call.

    Every request message is parsed by ``common/request_guard.py``, so a malformed one answers
    INVALID_ARGUMENT; with ``max_message_bytes`` a larger one does too (gRPC's own receive limit
    is then twice that).
    """
    options = SERVER_OPTIONS
    if max_message_bytes is not None:
        options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", 2 * max_message_bytes))
    server = grpc.aio.server(options=options,
                             interceptors=[*interceptors, RequestGuard(max_message_bytes)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


async def set_serving(health_servicer, service_names: list[str], serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


def bind(server: grpc.aio.Server, host: str, port: int,
         credentials: grpc.ServerCredentials | None = None) -> str:
    """Bind a port (0 = any free one), TLS when ``credentials`` are given, and return the
    ``host:port`` actually bound. Raises OSError, saying why, when it cannot be bound."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:  # what grpc raises for a port in use or an address not of this host
        bound = 0
    if bound == 0:
        reason = bind_problem(host, port) or "gRPC refused the address"
        raise OSError(f"cannot listen on {address}: {reason}")
    return f"{host}:{bound}"


def bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` (e.g. "Address already in use"), asked
    of the OS with a probe socket; None when it could. gRPC's own error does not say why."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc.strerror})"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # as gRPC's listeners do: then only a listening socket, not a closed connection
            # waiting out TIME_WAIT, makes the port count as in use
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                return exc.strerror or str(exc)
    return None


async def serve_until_signal(server: grpc.aio.Server, health_servicer, service_names: list[str],
                             announce: str, on_stop: Callable[[], Awaitable[None]] | None = None,
                             grace: float = 5.0, *, shutdown: GracefulShutdown | None = None,
                             engine=None, watch_interval_s: float = 0.5) -> int:
    """Start, report SERVING, print ``announce`` (the line process managers wait for), and run
    until SIGINT/SIGTERM, then stop gracefully (``common/shutdown.py``: running calls get
    ``grace`` seconds) and return 0.

    With ``engine`` (anything with ``is_alive`` and ``error``, an ``EngineLoop``), its thread is
    watched: once it has died the server reports NOT_SERVING, ends its calls and this returns
    ``ENGINE_STOPPED_EXIT``, so that the process exits non-zero and its supervisor
    (``flashsplit up``) replaces it. ``on_stop`` runs after the server has stopped.
    """
    shutdown = shutdown or GracefulShutdown("server")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    await set_serving(health_servicer, service_names, True)
    print(announce, flush=True)
    sys.stdout.flush()
    waits = {asyncio.ensure_future(stop.wait())}
    if engine is not None:
        waits.add(asyncio.ensure_future(_until_stopped(engine, watch_interval_s)))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    status = 0
    if stop.is_set():
        log.info("shutting down: running calls get %.1f s", grace)
    else:
        log.error("the engine thread has stopped (%r): reporting NOT_SERVING and exiting",
                  engine.error)
        # its calls cannot finish without the engine; they end with the engine's error
        grace, status = min(grace, 1.0), ENGINE_STOPPED_EXIT
    await stop_gracefully(server, health_servicer, shutdown, grace)
    if on_stop is not None:
        await on_stop()
    return status


async def _until_stopped(engine, interval_s: float) -> None:
    while engine.is_alive:
        await asyncio.sleep(interval_s)


async def abort_if_engine_stopped(engine, context) -> None:
    """End a call with UNAVAILABLE when the worker's engine thread has died: the router takes
    the worker out until it answers again."""
    if not engine.is_alive:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine stopped: {engine.error!r}")

