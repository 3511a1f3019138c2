"""The HTTP API's server: uvicorn, on the router's own asyncio loop, beside the gRPC server.

Running in the same loop (rather than a thread or a process) lets HTTP handlers call the
router's ``Generation`` directly: one dispatcher, one registry, one set of worker channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn

from router.generation import Generation
from router.openai_api.config import HttpConfig
from router.registry import WorkerRegistry

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router process owns SIGTERM and SIGINT and
    stops this server itself, in order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket (port 0 = any free one); OSError saying why when it cannot be had."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port} (HTTP): cannot resolve {host!r} "
                      f"({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    # as uvicorn's own listener: a connection in TIME_WAIT does not keep the port from reuse
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} (HTTP): {exc.strerror or exc}") from None
    return sock


class HttpServer:
    """start() serves ``app`` on the running loop and returns host:port; stop() ends it."""

    def __init__(self, app, config: HttpConfig, *, grace_s: float = 5.0) -> None:
        self.config = config
        tls = {}
        if config.tls_cert:
            tls = dict(ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
                       ssl_ca_certs=config.tls_ca,
                       ssl_cert_reqs=ssl.CERT_REQUIRED if config.require_client_cert
                       else ssl.CERT_NONE)
        self._server = _Server(uvicorn.Config(
            app, lifespan="off", access_log=False, log_level="warning",
            timeout_graceful_shutdown=max(int(grace_s), 1), **tls))
        self._task: asyncio.Task | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> str:
        """Bind (the socket is ours, so a failed bind is an OSError here, not an exit inside
        uvicorn) and serve; returns host:port with the bound port."""
        sock = _listen(self.config.host, self.config.port)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-server")
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {self.address} stopped while starting")
            await asyncio.sleep(0.01)
        log.info("HTTP API on %s://%s", self.config.scheme, self.address)
        return self.address

    async def stop(self) -> None:
        """Stop accepting connections, give open ones the grace period, then close."""
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._task = None


def model_names(model: str, served_model_name: str | None) -> tuple[str, ...]:
    """The names ``model`` may take in a request; the first is the one answers carry."""
    if served_model_name:
        return (served_model_name,)
    return tuple(dict.fromkeys((model, Path(model).name or model)))


def ready_reason(registry: WorkerRegistry) -> str | None:
    """None when some healthy prefill and decode worker can take requests, else why not."""
    workers = registry.workers()
    for kind in ("prefill", "decode"):
        if not any(w.kind == kind and w.healthy for w in workers):
            down = [f"{w.address} ({w.last_error or 'not answered yet'})"
                    for w in workers if w.kind == kind]
            return f"no healthy {kind} worker: {', '.join(down) or 'none configured'}"
    return None


def build_http_server(generation: Generation, config: HttpConfig, *, model: str,
                      accepts: Callable[[str | None], bool], grace_s: float) -> HttpServer:
    """The HTTP API over the router's ``generation``, with the model's chat template.

    ValueError when the checkpoint's chat template does not compile.
    """
    from common.chat_template import load_chat_template
    from router.openai_api.app import OpenAIApi, create_app

    api = OpenAIApi(generation, model_names=model_names(model, config.served_model_name),
                    chat_template=load_chat_template(model), accepts=accepts,
                    ready=lambda: ready_reason(generation.dispatcher.registry))
    return HttpServer(create_app(api), config, grace_s=grace_s)
