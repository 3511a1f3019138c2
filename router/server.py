"""The public ``flashsplit.v1.Generation`` service: protobuf in, dispatcher, protobuf out.

The servicer only translates: checks, tokenization, stop strings and the run itself go through
``router/generation.py`` (shared with the HTTP API), worker choice and retries through
``router/dispatch.py``. ``Router`` assembles registry, clients, dispatcher, servicer, health and
reflection into one server that tests can start on port 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from common.convert import (finish_reason_to_pb, load_report_to_pb, logprobs_to_pb,
                            sampling_from_pb, token_ids_from_pb)
from common.channels import ChannelSecurity
from common.grpc_util import bind, make_server, set_serving
from common.metrics.server import MetricsServer
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from common.security import ServerSecurity
from common.shutdown import GracefulShutdown, stop_gracefully
from common.tokenizer import Tokenizer, load_tokenizer
from router.client import ClientConfig, WorkerClients
from router.discovery import (DiscoveryConfig, Resolver, SystemResolver, WorkerDiscovery,
                              parse_targets)
from router.dispatch import Dispatcher, DispatchConfig, DispatchError, Job
from router.generation import Generation
from router.limits import RequestLimits
from router.openai_api.config import HttpConfig
from router.registry import RegistryConfig, WorkerRegistry
from router.requests import Delta, OutputTracker, ServedModel, load_served_model

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_KIND_PB = {"prefill": types_pb2.WORKER_KIND_PREFILL, "decode": types_pb2.WORKER_KIND_DECODE}


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router process is started with."""

    model: str
    # each host:port or dns:///name:port (router/discovery.py)
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    clients: ClientConfig = field(default_factory=ClientConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    grace_s: float = 5.0
    # the internal token (and TLS) of every call to a worker; what the public port demands
    internal: ChannelSecurity = field(default_factory=ChannelSecurity)
    public: ServerSecurity = field(default_factory=ServerSecurity)
    # the OpenAI-compatible HTTP API beside the gRPC one (None: not served)
    http: HttpConfig | None = None
    # caps on prompt and message sizes (router/limits.py)
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Prometheus metrics on a port of their own (None: only at the HTTP API's /metrics), over
    # TLS with the context (common/metrics/tls.py) when the router has --tls-cert
    metrics_port: int | None = None
    metrics_ssl_context: ssl.SSLContext | None = None


def delta_to_pb(request_id: str, delta: Delta) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(
        request_id=request_id, text=delta.text, token_ids=list(delta.token_ids),
        accept_lengths=list(delta.accept_lengths),
        finish_reason=finish_reason_to_pb(delta.finish_reason),
        logprobs=[logprobs_to_pb(lp) for lp in delta.logprobs])
    if delta.finish_reason is not None:
        msg.usage.prompt_tokens = delta.prompt_tokens
        msg.usage.completion_tokens = delta.completion_tokens
        t = delta.timings
        msg.timings.CopyFrom(generation_pb2.Timings(
            time_to_first_token_s=t.time_to_first_token_s,
            inter_token_latencies_s=list(t.inter_token_latencies_s), total_s=t.total_s,
            prefill_queue_s=t.prefill_queue_s, prefill_s=t.prefill_s, handoff_s=t.handoff_s))
    return msg


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Generate / GenerateOnce / GetModelInfo / ListWorkers over a dispatcher."""

    def __init__(self, generation: Generation, shutdown: GracefulShutdown | None = None) -> None:
        self.generation = generation
        # once the shutdown grace is over, running calls end with finish reason ABORT
        self.shutdown = shutdown or GracefulShutdown("router")
        self.model = generation.model
        self.registry = generation.dispatcher.registry

    async def _admit(self, request: generation_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> tuple[Job, OutputTracker]:
        """Validate and tokenize; aborts the call with INVALID_ARGUMENT on bad input."""
        arrival = self.generation.dispatcher.clock()
        try:
            which = request.WhichOneof("input")
            if which is None:
                raise ValueError("the request has neither text nor token_ids")
            return await self.generation.admit(
                request.text if which == "text" else token_ids_from_pb(request.token_ids.ids),
                sampling_from_pb(request.sampling), request_id=request.request_id,
                stop=list(request.stop),
                arrival=arrival, timeout_s=context.time_remaining())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _deltas(self, job: Job, tracker: OutputTracker,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Delta]:
        """Run the job; failures end the call with the dispatcher's status."""
        try:
            async with contextlib.aclosing(self.generation.run(job, tracker)) as deltas:
                async for delta in deltas:
                    yield delta
        except DispatchError as exc:
            log.warning("[%s] failed after %d tokens: %s", job.spec.request_id,
                        len(tracker.token_ids), exc.message)
            await context.abort(exc.code, exc.message)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a bug: the client gets INTERNAL, the log gets the trace
            log.exception("[%s] internal error", job.spec.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"router error: {exc!r}")

    def _cut_short(self, tracker: OutputTracker) -> str:
        return (f"{self.shutdown.message}: the request was aborted after "
                f"{len(tracker.token_ids)} tokens")

    async def Generate(self, request, context):
        job, tracker = await self._admit(request, context)
        try:
            with self.shutdown.cancelled_at_expiry():
                async for delta in self._deltas(job, tracker, context):
                    yield delta_to_pb(job.spec.request_id, delta)
        except asyncio.CancelledError:
            if not self.shutdown.expired.is_set():
                raise
            # the shutdown grace is over (the workers were told to abort): a last message
            # with finish reason ABORT, then a status that says why
            end = tracker.add((), self.generation.dispatcher.clock(), (), "abort")
            yield delta_to_pb(job.spec.request_id, end)
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._cut_short(tracker))

    async def GenerateOnce(self, request, context):
        job, tracker = await self._admit(request, context)
        last = None
        try:
            with self.shutdown.cancelled_at_expiry():
                async for delta in self._deltas(job, tracker, context):
                    last = delta
        except asyncio.CancelledError:
            if not self.shutdown.expired.is_set():
                raise
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._cut_short(tracker))
        whole = Delta(text=tracker.text, token_ids=tuple(tracker.token_ids),
                      accept_lengths=tuple(tracker.accept_lengths),
                      finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens,
                      completion_tokens=last.completion_tokens, timings=last.timings,
                      logprobs=tuple(tracker.logprobs))
        return delta_to_pb(job.spec.request_id, whole)

    async def GetModelInfo(self, request, context):
        m = self.model
        return generation_pb2.ModelInfo(
            model_name=m.name, model_type=m.model_type,
            model_fingerprint=self.registry.fingerprint(), vocab_size=m.vocab_size,
            max_context_len=m.max_context_len, eos_token_ids=list(m.eos_token_ids),
            # a decode worker with a draft reports DFLASH counters in its load
            speculative_available=any(
                w.kind == "decode" and w.healthy and w.load is not None
                and "spec_steps" in w.load.counters for w in self.registry.workers()),
            dtype=m.dtype)

    async def ListWorkers(self, request, context):
        workers = []
        for w in self.registry.workers():
            info = generation_pb2.WorkerInfo(address=w.address, kind=_KIND_PB[w.kind],
                                             healthy=w.healthy, last_error=w.last_error)
            if w.load is not None:
                info.load.CopyFrom(load_report_to_pb(w.load))
            workers.append(info)
        return generation_pb2.ListWorkersResponse(workers=workers)


class Router:
    """The router's gRPC server with its registry and worker clients; start() then stop()."""

    def __init__(self, config: RouterConfig, *, tokenizer: Tokenizer | None = None,
                 model: ServedModel | None = None, resolver: Resolver | None = None) -> None:
        """``resolver`` turns the dns:/// targets into addresses (default: the host's DNS)."""
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model, allow_missing=True)
        self.model = model or load_served_model(config.model, self.tokenizer)
        self.clients = WorkerClients(config.clients, config.internal)
        targets = parse_targets(config.prefill, config.decode)
        self.registry = WorkerRegistry(WorkerDiscovery.fixed_workers(targets),
                                       self.clients.get_load, config.registry)
        self.discovery = WorkerDiscovery(targets, self.registry, resolver or SystemResolver(),
                                         config.discovery, on_removed=self.clients.forget)
        self.dispatcher = Dispatcher(self.registry, self.clients, config.dispatch)
        self.generation = Generation(self.model, self.tokenizer, self.dispatcher,
                                     config.limits)
        self.shutdown = GracefulShutdown("router")
        self.health: health.aio.HealthServicer | None = None
        self.server: grpc.aio.Server | None = None
        self.http = None  # router.openai_api.server.HttpServer while serving HTTP
        self.metrics_server: MetricsServer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> str:
        """Bind, poll the workers once, serve; returns host:port (the bound port when 0)."""
        http = self.config.http
        if http is not None and self.config.public.tls is not None and not http.tls_cert:
            # a plaintext HTTP port beside a TLS gRPC one would undo what TLS is there for
            raise ValueError("the router serves TLS on gRPC but its HTTP config has no "
                             "certificate")
        server, self.health = make_server(
            [*self.config.public.interceptors(), self.shutdown.interceptor()],
            max_message_bytes=self.config.limits.max_message_bytes)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.generation, self.shutdown), server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.port = int(bind(server, self.config.host, self.config.port,
                             self.config.public.credentials()).rsplit(":", 1)[1])
        if self.config.metrics_port is not None:
            self.metrics_server = MetricsServer(self.config.host, self.config.metrics_port,
                                                self.config.metrics_ssl_context)
            self.metrics_server.start(self.generation.metrics.registry)
        await self.discovery.start()
        await self.registry.start()
        await server.start()
        self.server = server
        if self.config.http is not None:
            try:
                await self._start_http(self.config.http)
            except BaseException:
                await self.stop(0)  # no half-started router: the gRPC port closes too
                raise
        await set_serving(self.health, [SERVICE_NAME], True)
        return self.address

    @property
    def metrics_address(self) -> str | None:
        """host:port of the ``--metrics-port`` endpoint (None when it is not served)."""
        return self.metrics_server.address if self.metrics_server is not None else None

    @property
    def http_address(self) -> str | None:
        """host:port of the HTTP API (None when it is not served)."""
        return self.http.address if self.http is not None else None

    async def _start_http(self, config: HttpConfig) -> None:
        # imported here: FastAPI and uvicorn are loaded only by a router that serves HTTP
        from router.openai_api.server import build_http_server

        self.http = build_http_server(self.generation, config, model=self.config.model,
                                      accepts=self.config.public.accepts,
                                      grace_s=self.config.grace_s)
        await self.http.start()

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking requests, let running ones finish for up to ``grace`` seconds, end the
        rest with finish reason ABORT (common/shutdown.py), close."""
        grace = self.config.grace_s if grace is None else grace
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        stopping = ([stop_gracefully(self.server, self.health, self.shutdown, grace)]
                    if self.server is not None else [])
        if self.http is not None:
            stopping.append(self.http.stop())
        await asyncio.gather(*stopping)
        await self.discovery.stop()
        await self.registry.stop()
        await self.dispatcher.drain()
        await self.clients.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
