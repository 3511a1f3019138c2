"""The OpenAI-compatible HTTP API as a FastAPI app over the router's ``Generation``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (unary, or streamed as
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, and
``GET /metrics`` (the router's Prometheus metrics, docs/metrics.md). Requests
run through the same ``Generation`` as the gRPC API (validation, tokenization, dispatch, stop
strings), so the same request gives the same tokens on both.

A streamed request waits for its first tokens before it answers, so a request that never starts
(no worker pair, all full) gets a proper error status; a failure after that ends the stream with
an error event. A client that goes away cancels its request, which aborts it on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.chat_template import ChatTemplate, ChatTemplateError
from common.metrics.server import exposition
from router.dispatch import DispatchError
from router.generation import Generation
from router.openai_api.choices import Choice, run_choices
from router.openai_api.errors import ApiError, invalid
from router.openai_api.logprobs import ChoiceLogprobs
from router.openai_api.protocol import (ChatCompletionRequest, CompletionRequest,
                                        GenerationFields, template_messages)
from router.openai_api.responses import DONE, ChunkWriter, FinishedChoice, Head, unary

log = logging.getLogger(__name__)
Code = grpc.StatusCode
# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def _disconnected(request: Request) -> None:
    # After the body has been read, the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnected(request: Request, awaitable):
    """Await ``awaitable``; cancel it and raise _ClientGone if the client leaves first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _parse(request: Request, model: type[BaseModel]):
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise invalid(f"{where}: {first['msg']}", where or None) from None


class OpenAIApi:
    """The handlers; ``create_app`` mounts them."""

    def __init__(self, generation: Generation, *, model_names: Sequence[str],
                 chat_template: ChatTemplate | None, accepts: Callable[[str | None], bool],
                 ready: Callable[[], str | None]) -> None:
        """accepts: whether an ``Authorization`` header value lets a call in (the router's
        public-port check, so HTTP and gRPC take the same keys); ready: None when requests can
        be served, else why not (for ``/health``)."""
        if not model_names:
            raise ValueError("the HTTP API needs at least one model name")
        self.generation = generation
        self.model_names = tuple(model_names)
        self.chat_template = chat_template
        self.accepts = accepts
        self.ready = ready
        self.created = int(time.time())

    def check_key(self, request: Request) -> None:
        if not self.accepts(request.headers.get("authorization")):
            raise ApiError(Code.UNAUTHENTICATED,
                           "missing or wrong API key (header 'Authorization: Bearer <key>')")

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.model_names:
            return self.model_names[0]
        raise ApiError(Code.NOT_FOUND, f"the model {requested!r} does not exist here; this "
                       f"server serves {', '.join(map(repr, self.model_names))}",
                       param="model", code="model_not_found")

    # -- routes ------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        reason = self.ready()
        if reason is not None:
            raise ApiError(Code.UNAVAILABLE, reason)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        # no API key, as /health: scrapers carry none, and the numbers hold no request's content
        body, content_type = exposition(self.generation.metrics.registry,
                                        request.headers.get("accept"))
        return Response(body, media_type=content_type)

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        ctx = self.generation.model.max_context_len
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "flashsplit",
             "max_model_len": ctx} for name in self.model_names]})

    async def completions(self, request: Request) -> Response:
        self.check_key(request)
        req: CompletionRequest = await _parse(request, CompletionRequest)
        model = self.model_name(req.model)
        req.check()
        arrival = self.generation.dispatcher.clock()
        rid = "cmpl-" + secrets.token_hex(12)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        choices: list[Choice] = []
        prompts = req.prompts()
        for prompt in prompts:
            try:
                ids = await self.generation.encode(prompt) if isinstance(prompt, str) \
                    else prompt
            except ValueError as exc:
                raise invalid(str(exc), "prompt") from None
            choices += await self._admit(req, ids, max_tokens, rid, len(choices), arrival,
                                         single=len(prompts) * req.n == 1)
        return await self._respond(request, req, Head(rid, int(time.time()), model, False),
                                   choices)

    async def chat_completions(self, request: Request) -> Response:
        self.check_key(request)
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        model = self.model_name(req.model)
        req.check()
        if self.chat_template is None:
            raise invalid("this model has no chat template (chat_template.jinja, or "
                          "chat_template in tokenizer_config.json): use /v1/completions")
        arrival = self.generation.dispatcher.clock()
        try:
            text = self.chat_template.render(
                template_messages(req.messages), add_generation_prompt=req.add_generation_prompt,
                **req.chat_template_kwargs)
            ids = await self.generation.encode(text, add_special_tokens=False)
        except (ChatTemplateError, ValueError) as exc:
            raise invalid(str(exc), "messages") from None
        max_tokens = req.max_tokens_or(self._room() - len(ids))
        rid = "chatcmpl-" + secrets.token_hex(12)
        choices = await self._admit(req, ids, max_tokens, rid, 0, arrival, single=req.n == 1)
        return await self._respond(request, req, Head(rid, int(time.time()), model, True),
                                   choices)

    # -- shared ------------------------------------------------------------------------------

    def _room(self) -> int:
        """The longest request (prompt plus completion) the server can take: the context,
        or less where the decode workers' pools cannot hold that much."""
        context = self.generation.model.max_context_len
        sizes = [w.load.max_request_tokens for w in self.generation.dispatcher.registry.workers()
                 if w.kind == "decode" and w.healthy and w.load is not None
                 and w.load.max_request_tokens > 0]
        return min(context, max(sizes)) if sizes else context

    async def _admit(self, req: GenerationFields, ids: Sequence[int], max_tokens: int,
                     rid: str, first_index: int, arrival: float, *,
                     single: bool) -> list[Choice]:
        """The n router requests of one prompt."""
        out = []
        for j in range(req.n):
            index = first_index + j
            try:
                job, tracker = await self.generation.admit(
                    ids, req.sampling(max_tokens, j), request_id=rid if single
                    else f"{rid}-{index}", stop=req.stop_strings(), arrival=arrival)
            except ValueError as exc:
                raise invalid(str(exc)) from None
            out.append(Choice(index, job, tracker))
        return out

    async def _respond(self, request: Request, req: GenerationFields, head: Head,
                       choices: list[Choice]) -> Response:
        n = req.n
        # n choices of one prompt count its tokens once, as OpenAI does
        prompt_tokens = sum(len(c.job.spec.prompt_ids) for c in choices if c.index % n == 0)
        stream = run_choices(self.generation, choices)
        # a formatter per choice (a streamed completion's text_offset runs across its chunks)
        formats = {c.index: ChoiceLogprobs(self.generation.tokenizer, head.chat)
                   for c in choices} if req.num_logprobs() is not None else {}
        if not req.stream:
            body = await _until_disconnected(
                request, self._collect(stream, head, choices, prompt_tokens,
                                       req.return_token_ids, formats))
            return JSONResponse(body)
        try:
            first = await _until_disconnected(request, anext(stream))
        except DispatchError as exc:
            raise ApiError(exc.code, exc.message) from None
        except BaseException:
            await stream.aclose()
            raise
        writer = ChunkWriter(head, req.include_usage(), req.return_token_ids)
        return StreamingResponse(self._events(stream, first, writer, choices, prompt_tokens,
                                              formats),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _collect(self, stream: AsyncIterator, head: Head, choices: list[Choice],
                       prompt_tokens: int, token_ids: bool,
                       formats: dict[int, ChoiceLogprobs]) -> dict:
        finish: dict[int, str] = {}
        try:
            async with contextlib.aclosing(stream) as deltas:
                async for index, delta in deltas:
                    if delta.finish_reason is not None:
                        finish[index] = delta.finish_reason
        except DispatchError as exc:
            raise ApiError(exc.code, exc.message) from None
        done = [FinishedChoice(c.index, c.tracker.text, finish[c.index],
                               tuple(c.tracker.token_ids), c.job.spec.prompt_ids,
                               formats[c.index].format(c.tracker.token_ids, c.tracker.logprobs)
                               if formats else None) for c in choices]
        return unary(head, done, prompt_tokens, token_ids)

    async def _events(self, stream: AsyncIterator, first: tuple, writer: ChunkWriter,
                      choices: list[Choice], prompt_tokens: int,
                      formats: dict[int, ChoiceLogprobs]) -> AsyncIterator[str]:
        try:
            for c in choices:
                if event := writer.start(c.index, c.job.spec.prompt_ids):
                    yield event
            item = first
            while item is not None:
                index, delta = item
                logprobs = formats[index].format(delta.token_ids, delta.logprobs) \
                    if formats and delta.token_ids else None
                if event := writer.delta(index, delta.text, delta.token_ids,
                                         delta.finish_reason, logprobs):
                    yield event
                item = await anext(stream, None)
            if event := writer.usage(prompt_tokens,
                                     sum(len(c.tracker.token_ids) for c in choices)):
                yield event
        except DispatchError as exc:
            yield writer.error(ApiError(exc.code, exc.message).body())
        except Exception as exc:  # a bug: the client gets a 500-shaped event, the log the trace
            log.exception("[%s] streaming failed", writer.head.id)
            yield writer.error(ApiError(Code.INTERNAL, f"router error: {exc!r}").body())
        finally:
            await stream.aclose()
        yield DONE


def create_app(api: OpenAIApi) -> FastAPI:
    """The ASGI app serving ``api``'s routes, with every error in OpenAI's shape."""
    app = FastAPI(title="flashsplit", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for this case

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = Code.NOT_FOUND if exc.status_code == 404 else Code.INVALID_ARGUMENT
        body = ApiError(code, f"{request.method} {request.url.path}: {exc.detail}").body()
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return JSONResponse(ApiError(Code.INTERNAL, f"router error: {exc!r}").body(),
                            status_code=500)

    return app
