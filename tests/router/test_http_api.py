"""The OpenAI-compatible HTTP API, driven with the official ``openai`` client and raw HTTP,
against an in-process router and fake workers (tests/router/fakes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import httpx
import openai
import pytest

from common.auth import MetadataCheck
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from common.security import ServerSecurity
from common.tokenizer import ByteTokenizer
from router.dispatch import DispatchConfig
from router.openai_api.config import HttpConfig
from router.openai_api.errors import STATUS_TABLE, http_status
from router.registry import RegistryConfig
from router.server import Router, RouterConfig
from tests.router.fakes import REPLY_IDS, REPLY_TEXT, start_fake

KEY = "k" * 32


@contextlib.asynccontextmanager
async def serving(api_key=None, dead_decode=False, max_attempts=3):
    """Fakes and a router serving gRPC and HTTP; yields (client, http, stub, prefill, decode)."""
    prefill, decode = await start_fake("prefill"), await start_fake("decode")
    public = ServerSecurity(check=MetadataCheck.api_key(api_key)) if api_key else \
        ServerSecurity()
    router = Router(RouterConfig(
        model="tiny", prefill=(prefill.address,),
        decode=("127.0.0.1:1",) if dead_decode else (decode.address,),
        registry=RegistryConfig(poll_interval_s=0.05, poll_timeout_s=2.0,
                                backoff_initial_s=30.0, backoff_max_s=60.0),
        dispatch=DispatchConfig(max_attempts=max_attempts, max_queue_wait_s=0.3), public=public,
        http=HttpConfig()))
    await router.start()
    base = f"http://{router.http_address}"
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=api_key or "unused",
                                max_retries=0, timeout=10)
    raw = httpx.AsyncClient(base_url=base, timeout=10)
    channel = grpc.aio.insecure_channel(router.address)
    try:
        yield (client, raw, generation_pb2_grpc.GenerationStub(channel), prefill.servicer,
               decode.servicer)
    finally:
        await client.close()
        await raw.aclose()
        await channel.close()
        await router.stop(0)
        await prefill.stop()
        await decode.stop()


def run(body):
    asyncio.run(asyncio.wait_for(body(), 30))


async def wait_for(predicate, timeout=3.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def sse_lines(raw, path, body):
    async with raw.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return [line async for line in resp.aiter_lines() if line]


def test_completions_unary_and_streamed_equal_the_grpc_api():
    async def body():
        async with serving() as (client, _, stub, _, decode):
            decode.knobs.tokens_per_event = 3
            grpc_out = await stub.GenerateOnce(generation_pb2.GenerateRequest(
                text="Hi", sampling=types_pb2.SamplingParams(max_new_tokens=200)), timeout=5)
            unary = await client.completions.create(
                model="tiny", prompt="Hi", max_tokens=200, extra_body={"return_token_ids": True})
            (choice,) = unary.choices
            assert choice.text == grpc_out.text == REPLY_TEXT
            assert choice.token_ids == list(grpc_out.token_ids) == list(REPLY_IDS)
            assert choice.finish_reason == "stop"
            assert (unary.usage.prompt_tokens, unary.usage.completion_tokens) == \
                (2, len(REPLY_IDS))
            assert unary.object == "text_completion" and unary.id.startswith("cmpl-")
            stream = await client.completions.create(model="tiny", prompt=[72, 105],
                                                     max_tokens=200, stream=True)
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].text for c in chunks) == REPLY_TEXT
            assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
            assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    run(body)


def test_chat_goes_through_the_template_and_streams_as_openai_does():
    async def body():
        async with serving() as (client, raw, _, prefill, _):
            unary = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=200)
            assert unary.choices[0].message.role == "assistant"
            assert unary.choices[0].message.content == REPLY_TEXT
            assert unary.object == "chat.completion"
            # the built-in template: BOS, then "role: content" lines, then the assistant turn
            expected = [ByteTokenizer.BOS_TOKEN_ID, *b"user: hi\nassistant:"]
            assert list(prefill.calls[0].prompt_token_ids) == expected
            lines = await sse_lines(raw, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_tokens": 200, "stream": True, "stream_options": {"include_usage": True}})
            assert lines[-1] == "data: [DONE]"
            events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            assert all(e["object"] == "chat.completion.chunk" for e in events)
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(e["choices"][0]["delta"].get("content") or ""
                           for e in events if e["choices"])
            assert text == REPLY_TEXT
            finish = events[-2]["choices"][0]
            assert finish["delta"] == {} and finish["finish_reason"] == "stop"
            assert events[-1]["choices"] == [] and events[-1]["usage"] == {
                "prompt_tokens": len(expected), "completion_tokens": len(REPLY_IDS),
                "total_tokens": len(expected) + len(REPLY_IDS)}
            assert all(e["usage"] is None for e in events[:-1])
            assert list(prefill.calls[1].prompt_token_ids) == expected
    run(body)


def test_stop_strings_across_token_boundaries_on_both_apis():
    async def body():
        async with serving() as (client, _, stub, _, decode):
            decode.knobs.tokens_per_event = 3  # "wörld" spans events and splits ö's bytes
            prefix = REPLY_TEXT[:REPLY_TEXT.index("wörld")]
            end = len(prefix.encode()) + len("wörld".encode())
            msgs = [m async for m in stub.Generate(generation_pb2.GenerateRequest(
                text="Hi", stop=["wörld", "never"],
                sampling=types_pb2.SamplingParams(max_new_tokens=200)), timeout=5)]
            assert "".join(m.text for m in msgs) == prefix
            assert [t for m in msgs for t in m.token_ids] == list(REPLY_IDS[:end])
            assert msgs[-1].finish_reason == types_pb2.FINISH_REASON_STOP
            assert msgs[-1].usage.completion_tokens == end
            for stream in (False, True):
                out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=200,
                                                      stop="wörld", stream=stream)
                chunks = [c async for c in out] if stream else [out]
                assert "".join(c.choices[0].text for c in chunks) == prefix
                assert chunks[-1].choices[0].finish_reason == "stop"
            chat = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=200,
                stop=["o, w"])
            assert chat.choices[0].message.content == "Héll"
            assert chat.choices[0].finish_reason == "stop"
    run(body)


def test_a_stop_string_ends_the_request_on_both_workers():
    async def body():
        async with serving() as (client, _, _, prefill, decode):
            decode.knobs.event_delay_s = 0.05  # the stream is still running at the match
            out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=200,
                                                  stop=["llo"])
            assert out.choices[0].text == "Hé" and out.choices[0].finish_reason == "stop"
            (hid,) = decode.streams
            await wait_for(lambda: hid in decode.aborts and hid in prefill.aborts)
            assert hid in decode.cancelled_streams
    run(body)


def test_a_client_that_goes_away_mid_stream_aborts_its_request():
    async def body():
        async with serving() as (_, raw, _, prefill, decode):
            decode.knobs.event_delay_s = 0.05
            async with raw.stream("POST", "/v1/completions", json={
                    "prompt": "Hi", "max_tokens": 200, "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        break
            (hid,) = decode.streams
            await wait_for(lambda: hid in decode.aborts and hid in prefill.aborts)
    run(body)


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}, 400, "top_logprobs", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty",
     "not_supported"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 999]}, 400, None, None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, None, None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content",
     "not_supported"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs", None),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role",
     None),
])
def test_errors_have_openai_shape_and_status(path, body, status, param, code):
    async def scenario():
        async with serving() as (_, raw, _, prefill, _):
            resp = await raw.post(path, json=body)
            assert resp.status_code == status, resp.text
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            assert (err["param"], err["code"]) == (param, code), err
            assert not prefill.calls  # refused before any worker was involved
    run(scenario)


def test_client_exceptions_bad_json_and_unknown_routes():
    async def body():
        async with serving() as (client, raw, _, _, _):
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="tiny", prompt="x", echo=True)
            assert "not supported yet" in info.value.message
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(
                    model="nope", messages=[{"role": "user", "content": "x"}])
            resp = await raw.post("/v1/completions", content=b"{not json")
            assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
            resp = await raw.get("/v1/nothing")
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    run(body)


def test_api_key_is_required_except_for_health():
    async def body():
        async with serving(api_key=KEY) as (client, raw, _, _, _):
            assert (await raw.get("/health")).status_code == 200
            resp = await raw.get("/v1/models")
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
            wrong = openai.AsyncOpenAI(base_url=client.base_url, api_key="x" * 32,
                                       max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.completions.create(model="tiny", prompt="x")
            await wrong.close()
            out = await client.completions.create(model="tiny", prompt="x", max_tokens=3)
            assert out.choices[0].text == ByteTokenizer().decode(REPLY_IDS[:3])
    run(body)


def test_unavailable_overloaded_and_mid_stream_failures():
    async def body():
        async with serving(max_attempts=1) as (client, raw, _, prefill, decode):
            prefill.knobs.fail_with = grpc.StatusCode.UNAVAILABLE
            resp = await raw.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert resp.status_code == 503  # before the first token: a status, not a stream
            assert resp.json()["error"]["code"] == "unavailable"
        async with serving() as (client, raw, _, prefill, decode):
            decode.knobs.refuse_with = grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(openai.RateLimitError) as info:
                await client.completions.create(model="tiny", prompt="x")
            assert info.value.status_code == 429
            decode.knobs.refuse_with = None
            decode.knobs.break_after = 4
            lines = await sse_lines(raw, "/v1/completions",
                                    {"prompt": "x", "max_tokens": 100, "stream": True})
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["error"]["type"] == "service_unavailable_error"
        async with serving() as (client, _, _, _, decode):
            # a fresh router: the one above marked its decode worker down
            decode.knobs.break_after = 4
            stream = await client.completions.create(model="tiny", prompt="x", max_tokens=100,
                                                     stream=True)
            with pytest.raises(openai.APIError):
                async for _ in stream:
                    pass
    run(body)


def test_health_models_and_choices():
    async def body():
        async with serving() as (client, raw, _, _, decode):
            assert (await raw.get("/health")).json() == {"status": "ok"}
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            out = await client.completions.create(model="tiny", prompt=["ab", "c"], n=2,
                                                  max_tokens=4, seed=7)
            assert [c.index for c in out.choices] == [0, 1, 2, 3]
            first4 = ByteTokenizer().decode(REPLY_IDS[:4])
            assert all(c.text == first4 for c in out.choices)
            assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 16
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], n=3,
                max_tokens=5, stream=True)
            texts = {}
            async for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            first5 = ByteTokenizer().decode(REPLY_IDS[:5])
            assert texts == {0: first5, 1: first5, 2: first5}
        async with serving(dead_decode=True) as (_, raw, _, _, _):
            resp = await raw.get("/health")
            assert resp.status_code == 503 and "no healthy decode" in \
                resp.json()["error"]["message"]
    run(body)


def test_status_table():
    assert http_status(grpc.StatusCode.INVALID_ARGUMENT).status == 400
    assert http_status(grpc.StatusCode.NOT_FOUND).status == 404
    assert http_status(grpc.StatusCode.UNAUTHENTICATED).status == 401
    assert http_status(grpc.StatusCode.RESOURCE_EXHAUSTED).status == 429
    assert http_status(grpc.StatusCode.UNAVAILABLE).status == 503
    assert http_status(grpc.StatusCode.DEADLINE_EXCEEDED).status == 504
    assert http_status(grpc.StatusCode.INTERNAL).status == 500
    assert http_status(grpc.StatusCode.DATA_LOSS).status == 500
    assert all(400 <= s.status < 600 for s in STATUS_TABLE.values())
