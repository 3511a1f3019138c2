"""Log-probabilities on the HTTP API, in OpenAI's shapes, against an in-process router and fake
workers whose log-probabilities are made up (tests/router/fakes.py): every token's entry is
there once, unary and streamed alike, with what the gRPC API reports for it."""

from __future__ import annotations

import json

import pytest

from common.pb.flashsplit.v1 import generation_pb2, types_pb2
from common.tokenizer import ByteTokenizer
from tests.router.fakes import REPLY_IDS
from tests.router.test_http_api import run, serving, sse_lines

FLOOR = -9999.0  # OpenAI's "very unlikely"; the fakes' first token is below it
MESSAGES = [{"role": "user", "content": "hi"}]


def text_of(token_id: int) -> str:
    return ByteTokenizer().decode([token_id], skip_special_tokens=False)


async def grpc_logprobs(stub, num_top: int, max_tokens: int = 200):
    out = await stub.GenerateOnce(generation_pb2.GenerateRequest(
        text="Hi", sampling=types_pb2.SamplingParams(max_new_tokens=max_tokens,
                                                     logprobs=num_top)), timeout=5)
    assert len(out.logprobs) == len(out.token_ids) == min(max_tokens, len(REPLY_IDS))
    return list(out.token_ids), [
        (lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs))) for lp in out.logprobs]


def completion_object(ids, logprobs) -> dict:
    """OpenAI's completion ``logprobs`` for what the gRPC API reported."""
    offsets, at = [], 0
    for t in ids:
        offsets.append(at)
        at += len(text_of(t))
    tops = []
    for t, (chosen, top) in zip(ids, logprobs):
        entry = {text_of(i): max(v, FLOOR) for i, v in top}
        entry.setdefault(text_of(t), max(chosen, FLOOR))
        tops.append(entry)
    return {"tokens": [text_of(t) for t in ids],
            "token_logprobs": [max(c, FLOOR) for c, _ in logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def chat_content(ids, logprobs) -> list[dict]:
    def entry(t, v):
        return {"token": text_of(t), "logprob": max(v, FLOOR),
                "bytes": list(text_of(t).encode())}
    return [{**entry(t, chosen), "top_logprobs": [entry(i, v) for i, v in top]}
            for t, (chosen, top) in zip(ids, logprobs)]


def merged_completion(events) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        lp = e["choices"][0]["logprobs"] if e["choices"] else None
        if lp is not None:
            for key in out:
                out[key] += lp[key]
    return out


@pytest.mark.parametrize("per_event", [1, 3])
def test_completion_logprobs_unary_and_streamed_are_the_grpc_ones(per_event):
    async def body():
        async with serving() as (client, raw, stub, _, decode):
            decode.knobs.tokens_per_event = per_event  # several tokens in one chunk
            ids, logprobs = await grpc_logprobs(stub, 2)
            expected = completion_object(ids, logprobs)
            assert expected["token_logprobs"][0] == FLOOR
            unary = await client.completions.create(model="tiny", prompt="Hi", max_tokens=200,
                                                    logprobs=2)
            assert unary.choices[0].logprobs.model_dump() == expected
            lines = await sse_lines(raw, "/v1/completions", {
                "prompt": "Hi", "max_tokens": 200, "logprobs": 2, "stream": True})
            events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            assert merged_completion(events) == expected
            # a chunk whose text is held back (a character's first byte) still has its entry
            assert any(e["choices"][0]["text"] == "" and e["choices"][0]["logprobs"]
                       for e in events) == (per_event == 1)
            stream = await client.completions.create(model="tiny", prompt="Hi", max_tokens=200,
                                                     logprobs=2, stream=True)
            tokens = [t async for c in stream if c.choices[0].logprobs
                      for t in c.choices[0].logprobs.tokens]
            assert tokens == expected["tokens"]
    run(body)


def test_chat_logprobs_unary_and_streamed_are_the_grpc_ones():
    async def body():
        async with serving() as (client, _, stub, _, _):
            ids, logprobs = await grpc_logprobs(stub, 3)
            expected = chat_content(ids, logprobs)
            unary = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=200, logprobs=True, top_logprobs=3)
            assert [c.model_dump() for c in unary.choices[0].logprobs.content] == expected
            stream = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=200, logprobs=True, top_logprobs=3,
                stream=True)
            streamed = [e.model_dump() async for c in stream for ch in c.choices
                        if ch.logprobs is not None for e in ch.logprobs.content]
            assert streamed == expected
            # logprobs without top_logprobs: the chosen token's only
            bare = await client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=5, logprobs=True)
            content = bare.choices[0].logprobs.content
            assert len(content) == 5 and all(c.top_logprobs == [] for c in content)
            plain = await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                         max_tokens=5)
            assert plain.choices[0].logprobs is None
    run(body)


def test_a_request_that_ends_at_its_first_token_has_its_logprobs():
    """max_tokens 1: no handoff; the first token's log-probabilities come from prefill."""
    async def body():
        async with serving() as (client, _, stub, _, decode):
            ids, logprobs = await grpc_logprobs(stub, 1, max_tokens=1)
            unary = await client.completions.create(model="tiny", prompt="Hi", max_tokens=1,
                                                    logprobs=1)
            assert unary.choices[0].logprobs.model_dump() == completion_object(ids, logprobs)
            assert not decode.handoffs
    run(body)


def test_workers_that_send_no_logprobs_fail_the_request():
    async def body():
        async with serving() as (_, raw, _, _, decode):
            decode.knobs.send_logprobs = False
            resp = await raw.post("/v1/completions", json={"prompt": "Hi", "logprobs": 1})
            assert resp.status_code == 500 and "log-probabilities" in resp.text
    run(body)
