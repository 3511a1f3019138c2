"""The public ``flashsplit.v1.Generation`` service: protobuf in, dispatcher, protobuf out.

The servicer only translates: checks and tokenization go through ``router/requests.py``, worker
choice and retries through ``router/dispatch.py``. ``Router`` assembles registry, clients,
dispatcher, servicer, health and reflection into one server that tests can start on port 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from common.convert import (finish_reason_to_pb, load_report_to_pb, sampling_from_pb,
                            speculative_from_pb)
from common.grpc_util import bind, make_server, set_serving
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from common.tokenizer import Tokenizer, load_tokenizer
from router.client import ClientConfig, WorkerClients
from router.dispatch import Dispatcher, DispatchConfig, DispatchError, Job
from router.registry import RegistryConfig, WorkerRegistry
from router.requests import (Delta, OutputTracker, ServedModel, check_prompt,
                             load_served_model, new_request_id, with_seed)

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# Longer texts are tokenized off the event loop, so one huge prompt does not stall other streams.
_TOKENIZE_INLINE_CHARS = 4096
_KIND_PB = {"prefill": types_pb2.WORKER_KIND_PREFILL, "decode": types_pb2.WORKER_KIND_DECODE}


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router process is started with."""

    model: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    clients: ClientConfig = field(default_factory=ClientConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    grace_s: float = 5.0


def delta_to_pb(request_id: str, delta: Delta) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(
        request_id=request_id, text=delta.text, token_ids=list(delta.token_ids),
        accept_lengths=list(delta.accept_lengths),
        finish_reason=finish_reason_to_pb(delta.finish_reason))
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

    def __init__(self, model: ServedModel, tokenizer: Tokenizer, dispatcher: Dispatcher) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.registry = dispatcher.registry

    async def _admit(self, request: generation_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> tuple[Job, OutputTracker]:
        """Validate and tokenize; aborts the call with INVALID_ARGUMENT on bad input."""
        arrival = self.dispatcher.clock()
        request_id = request.request_id or new_request_id()
        try:
            params = with_seed(sampling_from_pb(request.sampling))
            which = request.WhichOneof("input")
            if which == "text":
                text = request.text
                ids = (self.tokenizer.encode(text) if len(text) <= _TOKENIZE_INLINE_CHARS
                       else await asyncio.to_thread(self.tokenizer.encode, text))
            elif which == "token_ids":
                ids = list(request.token_ids.ids)
            else:
                raise ValueError("the request has neither text nor token_ids")
            check_prompt(ids, params, self.model)
        except ValueError as exc:
            log.info("[%s] rejected: %s", request_id, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remaining = context.time_remaining()
        job = Job(request_id=request_id, prompt_ids=tuple(ids), sampling=params,
                  speculative=speculative_from_pb(request.sampling),
                  arrival=arrival, deadline=None if remaining is None else arrival + remaining)
        log.info("[%s] %d prompt tokens, max_new_tokens %d", request_id, len(ids),
                 params.max_new_tokens)
        return job, OutputTracker(self.tokenizer, job.prompt_ids, arrival)

    async def _deltas(self, job: Job, tracker: OutputTracker,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Delta]:
        """Run the job; failures end the call with the dispatcher's status."""
        try:
            async with contextlib.aclosing(self.dispatcher.run(job)) as chunks:
                async for c in chunks:
                    times = (c.prefill.queue_s, c.prefill.prefill_s, c.prefill.handoff_s) \
                        if c.prefill else None
                    yield tracker.add(c.token_ids, c.arrival, c.accept_lengths,
                                      c.finish_reason, times)
        except DispatchError as exc:
            log.warning("[%s] failed after %d tokens: %s", job.request_id,
                        len(tracker.token_ids), exc.message)
            await context.abort(exc.code, exc.message)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a bug: the client gets INTERNAL, the log gets the trace
            log.exception("[%s] internal error", job.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"router error: {exc!r}")
        log.info("[%s] done: %d tokens in %.3f s", job.request_id, len(tracker.token_ids),
                 self.dispatcher.clock() - job.arrival)

    async def Generate(self, request, context):
        job, tracker = await self._admit(request, context)
        async for delta in self._deltas(job, tracker, context):
            yield delta_to_pb(job.request_id, delta)

    async def GenerateOnce(self, request, context):
        job, tracker = await self._admit(request, context)
        last = None
        async for delta in self._deltas(job, tracker, context):
            last = delta
        whole = Delta(text=tracker.text, token_ids=tuple(tracker.token_ids),
                      accept_lengths=tuple(tracker.accept_lengths),
                      finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens,
                      completion_tokens=last.completion_tokens, timings=last.timings)
        return delta_to_pb(job.request_id, whole)

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
                 model: ServedModel | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model, allow_missing=True)
        self.model = model or load_served_model(config.model, self.tokenizer)
        self.clients = WorkerClients(config.clients)
        workers = [(a, "prefill") for a in config.prefill] + [(a, "decode") for a in config.decode]
        self.registry = WorkerRegistry(workers, self.clients.get_load, config.registry)
        self.dispatcher = Dispatcher(self.registry, self.clients, config.dispatch)
        self.health: health.aio.HealthServicer | None = None
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> str:
        """Bind, poll the workers once, serve; returns host:port (the bound port when 0)."""
        server, self.health = make_server()
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.model, self.tokenizer, self.dispatcher), server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.port = int(bind(server, self.config.host, self.config.port).rsplit(":", 1)[1])
        await self.registry.start()
        await server.start()
        self.server = server
        await set_serving(self.health, [SERVICE_NAME], True)
        return self.address

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking requests, let running ones finish for up to ``grace`` seconds, close."""
        grace = self.config.grace_s if grace is None else grace
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace)
        await self.registry.stop()
        await self.dispatcher.drain()
        await self.clients.close()
