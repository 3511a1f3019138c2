"""The HTTP API of a real cluster (router, prefill and decode processes, the built-in model),
driven with the official ``openai`` client: it gives the gRPC API's tokens."""

from __future__ import annotations

import asyncio
import time

import grpc
import openai
import pytest

from common.chat_template import load_chat_template
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from common.sampling import SamplingParams
from common.tokenizer import ByteTokenizer
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb

WORKER_ARGS = ("--page-size", "16", "--num-pages", "1024", "--num-slots", "16")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"}]
TOKEN_IDS = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(model="tiny", worker_args=WORKER_ARGS, router_http_port=0,
                           router_args=("--poll-interval", "0.1"), start_timeout_s=120)
    with Cluster(config) as c:
        yield c


@pytest.fixture()
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused",
                       max_retries=0, timeout=60) as c:
        yield c


def grpc_tokens(cluster, params, *, text=None, ids=None, stop=()):
    out = asyncio.run(generate(cluster.router_address, request_to_pb(
        text=text, token_ids=ids, params=params, stop=stop)))
    return out.token_ids, out.text, out.finish_reason


def streamed(stream):
    ids, text, finish = [], "", None
    for chunk in stream:
        for c in chunk.choices:
            ids += getattr(c, "token_ids", None) or []
            text += (c.delta.content or "") if hasattr(c, "delta") else c.text
            finish = c.finish_reason or finish
    return ids, text, finish


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 11)])
def test_completions_give_the_grpc_tokens(cluster, client, temperature, seed):
    params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=12,
                            ignore_eos=True)
    for prompt in ("The quick brown fox", [5, 17, 200, 33]):
        kind = {"text": prompt} if isinstance(prompt, str) else {"ids": prompt}
        ids, text, _ = grpc_tokens(cluster, params, **kind)
        assert len(ids) == 12
        unary = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                          temperature=temperature, seed=seed,
                                          extra_body=TOKEN_IDS)
        assert unary.choices[0].token_ids == ids and unary.choices[0].text == text
        assert unary.choices[0].finish_reason == "length"
        assert streamed(client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=temperature, seed=seed,
            stream=True, extra_body=TOKEN_IDS)) == (ids, text, "length")


def test_chat_gives_the_grpc_tokens_of_the_rendered_template(cluster, client):
    prompt_ids = ByteTokenizer().encode(load_chat_template("tiny").render(MESSAGES),
                                        add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    ids, text, _ = grpc_tokens(cluster, params, ids=prompt_ids)
    unary = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                           temperature=0, extra_body=TOKEN_IDS)
    assert unary.choices[0].token_ids == ids and unary.choices[0].message.content == text
    assert unary.usage.prompt_tokens == len(prompt_ids)
    assert streamed(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        extra_body=TOKEN_IDS)) == (ids, text, "length")


async def _decode_counters(address: str) -> dict[str, int]:
    """The decode workers' counters (summed), read through the router's ListWorkers."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        workers = (await stub.ListWorkers(generation_pb2.ListWorkersRequest())).workers
    out: dict[str, int] = {}
    for w in workers:
        if w.kind == types_pb2.WORKER_KIND_DECODE:
            for k, v in w.load.counters.items():
                out[k] = out.get(k, 0) + v
    return out


async def _wait_aborted(address: str, at_least: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        aborted = (await _decode_counters(address)).get("aborted", 0)
        if aborted >= at_least or time.monotonic() > deadline:
            return aborted
        await asyncio.sleep(0.1)


def test_stop_strings_end_requests_on_both_apis_and_free_the_workers(cluster, client):
    long = 3000  # far more than a stop string lets the requests run
    params = SamplingParams(temperature=0.0, max_new_tokens=long, ignore_eos=True)
    prompt = [7, 8, 9, 10]
    aborted = asyncio.run(_decode_counters(cluster.router_address)).get("aborted", 0)
    _, full, _ = grpc_tokens(cluster, SamplingParams(temperature=0.0, max_new_tokens=40,
                                                     ignore_eos=True), ids=prompt)
    # three characters from the middle of the text: byte tokens, so the match spans tokens
    stop = next(full[i:i + 3] for i in range(6, len(full) - 3)
                if "\ufffd" not in full[i:i + 3])
    expected = full[:full.index(stop)]
    ids, text, finish = grpc_tokens(cluster, params, ids=prompt, stop=[stop])
    assert (text, finish) == (expected, "stop") and len(ids) < 40
    unary = client.completions.create(model="tiny", prompt=prompt, max_tokens=long,
                                      temperature=0, stop=stop, extra_body=TOKEN_IDS)
    assert unary.choices[0].text == expected and unary.choices[0].token_ids == ids
    _, stream_text, stream_finish = streamed(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=long, temperature=0, stop=[stop],
        stream=True, extra_body=TOKEN_IDS))
    assert (stream_text, stream_finish) == (expected, "stop")
    # each of the three was aborted on the decode worker, long before its last token
    assert asyncio.run(_wait_aborted(cluster.router_address, aborted + 3)) >= aborted + 3
