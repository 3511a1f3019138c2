"""Sending one benchmark request and timing it at the client: the gRPC API or OpenAI's.

Every request streams. Time to first token is measured to the first message that carries a
token; each later message adds one inter-token gap for its first token and 0 for the others
it carries (several tokens arrive together after a speculative step), the convention of the
router's own timings. An OpenAI-compatible stream says how many tokens a chunk holds only when
the server sends ``token_ids``; otherwise each chunk with text counts as one token for the
gaps, and the total comes from the closing ``usage``.
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass, field

import grpc
import httpx

from common.channels import ChannelSecurity, make_channel
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc
from common.sampling import SamplingParams
from router.bench.config import BenchConfig
from router.bench.workload import BenchRequest
from router.remote import request_to_pb


@dataclass
class RequestResult:
    """What one request measured (seconds; ``start_s`` relative to the load point's start)."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    start_s: float = 0.0


class _Timer:
    """Arrival bookkeeping shared by both backends."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.result.ttft_s = now - self.start
        else:
            self.result.itl_s.append(now - self.last)
        self.result.itl_s.extend([0.0] * (n - 1))
        self.last = now

    def done(self) -> RequestResult:
        self.result.e2e_s = time.perf_counter() - self.start
        return self.result


class GrpcBackend:
    """Requests to a router's ``flashsplit.v1.Generation`` (streaming ``Generate``)."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self._channel = make_channel(config.url, ChannelSecurity.public(config.api_key,
                                                                        config.tls))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def model_name(self) -> str:
        info = await self._stub.GetModelInfo(generation_pb2.ModelInfoRequest(), timeout=10)
        return info.model_name

    async def send(self, req: BenchRequest) -> RequestResult:
        c = self.config
        params = SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                                seed=req.seed, max_new_tokens=req.max_tokens,
                                ignore_eos=c.ignore_eos, speculative=c.speculative)
        pb = request_to_pb(text=req.prompt, params=params) if isinstance(req.prompt, str) \
            else request_to_pb(token_ids=req.prompt, params=params)
        result = RequestResult()
        timer = _Timer(result)
        try:
            async for msg in self._stub.Generate(pb, timeout=c.timeout_s):
                timer.tokens(len(msg.token_ids))
                result.output_tokens += len(msg.token_ids)
                if msg.finish_reason:
                    result.prompt_tokens = msg.usage.prompt_tokens
            result.ok = True
        except grpc.aio.AioRpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"
        return timer.done()

    async def close(self) -> None:
        await self._channel.close()


class OpenAIBackend:
    """Requests to any OpenAI-compatible server (flashsplit's HTTP API, vLLM, SGLang, ...)."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        verify: ssl.SSLContext | bool = True
        if config.tls is not None and config.tls.root_ca is not None:
            verify = ssl.create_default_context(cadata=config.tls.root_ca.decode())
        self._client = httpx.AsyncClient(
            base_url=config.base_url, headers=headers, verify=verify,
            timeout=httpx.Timeout(config.timeout_s, connect=10.0),
            # one connection per request in flight: the load generator must not queue them
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self._path = "/chat/completions" if config.endpoint == "chat" else "/completions"
        self.model = config.model

    async def model_name(self) -> str:
        if self.model is None:
            resp = await self._client.get("/models")
            resp.raise_for_status()
            models = resp.json().get("data") or []
            if not models:
                raise ValueError(f"{self.config.base_url}/models lists no model: give --model")
            self.model = models[0]["id"]
        return self.model

    def _body(self, req: BenchRequest) -> dict:
        c = self.config
        body: dict = {"model": self.model, "max_tokens": req.max_tokens,
                      "temperature": c.temperature, "top_p": c.top_p, "seed": req.seed,
                      "stream": True, "stream_options": {"include_usage": True}}
        if c.top_k:
            body["top_k"] = c.top_k
        if c.ignore_eos:
            body["ignore_eos"] = True  # vLLM and SGLang take it too
        if c.speculative is not None:
            body["speculative"] = c.speculative
        prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        if c.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def send(self, req: BenchRequest) -> RequestResult:
        result = RequestResult()
        timer = _Timer(result)
        counted = 0
        try:
            async with self._client.stream("POST", self._path, json=self._body(req)) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {_error_message(text)}"
                    return timer.done()
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        result.error = _error_message(data)
                        return timer.done()
                    n = sum(_chunk_tokens(ch) for ch in obj.get("choices") or ())
                    timer.tokens(n)
                    counted += n
                    if obj.get("usage"):
                        result.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                        result.output_tokens = obj["usage"].get("completion_tokens", counted)
            result.output_tokens = result.output_tokens or counted
            result.ok = True
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        return timer.done()

    async def close(self) -> None:
        await self._client.aclose()


def _chunk_tokens(choice: dict) -> int:
    if choice.get("token_ids"):
        return len(choice["token_ids"])
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return 1 if text else 0


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        return err.get("message", text) if isinstance(err, dict) else str(err or text)
    except (json.JSONDecodeError, AttributeError):
        return text[:500]


def make_backend(config: BenchConfig) -> GrpcBackend | OpenAIBackend:
    return GrpcBackend(config) if config.backend == "grpc" else OpenAIBackend(config)
