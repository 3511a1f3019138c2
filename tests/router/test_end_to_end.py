"""The real thing on 127.0.0.1: router, prefill and decode workers as separate processes."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import torch

from common.channels import ChannelSecurity, make_channel
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.model.load import load_model
from common.pb.flashsplit.v1 import types_pb2, decode_pb2_grpc, prefill_pb2_grpc
from common.sampling import SamplingParams
from common.tls import TlsFiles
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.common.model.checkpoints import load_hf_model, make_checkpoint

PAGE = 4
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
WORKER_ARGS = ("--page-size", str(PAGE), "--num-pages", "512", "--num-slots", "40")
# prefill in chunks of 5 tokens: long prompts cross chunk and page boundaries on the prefill side
CHUNKED = WORKER_ARGS + ("--max-prefill-tokens", "5")


def local_greedy(model, prompts, params=GREEDY):
    engine = LLMEngine(model, EngineConfig(cache=CacheConfig(page_size=PAGE, num_pages=512,
                                                             num_slots=40)))
    return [r.output_ids for r in engine.generate(prompts, params)]


async def generate_all(address, prompts, params=GREEDY):
    return await asyncio.gather(*[generate(address, request_to_pb(token_ids=p, params=params))
                                  for p in prompts])


async def worker_load(address: str, kind: str, token: str,
                      tls: TlsFiles | None = None) -> types_pb2.LoadReport:
    """A worker's load report, asked with its cluster's internal token (and ``tls``)."""
    async with make_channel(address, ChannelSecurity.internal(token, tls)) as channel:
        stub = (prefill_pb2_grpc.PrefillStub if kind == "prefill"
                else decode_pb2_grpc.DecodeStub)(channel)
        return await stub.GetLoad(types_pb2.LoadRequest(), timeout=5)


async def wait_all_free(cluster, timeout_s=10.0, tls: TlsFiles | None = None):
    """Poll every worker until its pages and slots are all free again; return the reports."""
    deadline = time.monotonic() + timeout_s
    while True:
        reports = [await worker_load(w.address, w.kind, cluster.internal_token, tls)
                   for w in cluster.workers]
        if all(r.free_pages == r.total_pages and r.free_slots == r.total_slots
               for r in reports) or time.monotonic() > deadline:
            return reports
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_split_equals_local_and_transformers(tmp_path, kind):
    path = make_checkpoint(kind, tmp_path / kind, seed=3)
    # shorter than a page, exactly one page, several pages plus a remainder
    prompts = [[5, 17, 200], [9, 8, 7, 6], [(i * 37 + 11) % 256 for i in range(PAGE * 3 + 2)]]
    expected = local_greedy(load_model(str(path)), prompts)
    hf = load_hf_model(kind, path)
    hf.generation_config.eos_token_id = None
    for prompt, ours in zip(prompts, expected):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0)
        assert ours == ref[0, len(prompt):].tolist()
    with Cluster(ClusterConfig(model=str(path), worker_args=CHUNKED)) as cluster:
        outs = asyncio.run(generate_all(cluster.router_address, prompts))
        assert [o.token_ids for o in outs] == expected
        assert all(o.finish_reason == "length" for o in outs)
        reports = asyncio.run(wait_all_free(cluster))
        assert all(r.free_pages == r.total_pages and r.free_slots == r.total_slots
                   for r in reports)


@pytest.fixture(scope="module")
def two_by_two():
    config = ClusterConfig(model="tiny", num_prefill=2, num_decode=2, worker_args=WORKER_ARGS)
    with Cluster(config) as cluster:
        yield cluster


def test_32_concurrent_streams_are_right_and_use_both_decode_workers(two_by_two):
    prompts = [[(7 * i + j) % 256 for j in range(1 + (i * 5) % 23)] for i in range(32)]
    expected = local_greedy(load_model("tiny"), prompts)
    token = two_by_two.internal_token
    before = [asyncio.run(worker_load(w.address, w.kind, token)) for w in two_by_two.workers]
    outs = asyncio.run(generate_all(two_by_two.router_address, prompts))
    assert [o.token_ids for o in outs] == expected
    after = [asyncio.run(worker_load(w.address, w.kind, token)) for w in two_by_two.workers]
    admitted = [a.counters["admitted"] - b.counters["admitted"]
                for w, b, a in zip(two_by_two.workers, before, after) if w.kind == "decode"]
    assert sum(admitted) == 32 and min(admitted) > 0, admitted
    prefilled = [a.counters["prefilled"] - b.counters["prefilled"]
                 for w, b, a in zip(two_by_two.workers, before, after) if w.kind == "prefill"]
    assert sum(prefilled) == 32


def test_cancelled_stream_frees_both_workers(two_by_two):
    start = asyncio.run(wait_all_free(two_by_two))

    async def cancel_mid_way():
        from common.pb.flashsplit.v1 import generation_pb2_grpc
        async with grpc.aio.insecure_channel(two_by_two.router_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
            call = stub.Generate(request_to_pb(token_ids=list(range(1, 40)), params=params))
            received = 0
            async for msg in call:
                received += len(msg.token_ids)
                if received >= 3:
                    break
            call.cancel()
            return received

    assert asyncio.run(cancel_mid_way()) >= 3
    end = asyncio.run(wait_all_free(two_by_two))
    assert [(r.free_pages, r.free_slots) for r in end] == \
        [(r.free_pages, r.free_slots) for r in start]
    aborted = sum(r.counters["aborted"] for r in end if r.kind == types_pb2.WORKER_KIND_DECODE)
    assert aborted >= 1  # freed by the cancellation, not by running to the end


def test_killed_decode_worker_fails_its_requests_and_others_carry_on():
    # room for all six long requests on either decode worker: every failure below is the kill's
    config = ClusterConfig(model="tiny", num_prefill=1, num_decode=2,
                           worker_args=("--page-size", "16", "--num-pages", "1024"),
                           router_args=("--poll-interval", "0.2"))
    long = SamplingParams(temperature=0.0, max_new_tokens=2000, ignore_eos=True)
    with Cluster(config) as cluster:
        decode = [w for w in cluster.workers if w.kind == "decode"]

        async def scenario():
            streaming = [asyncio.Event() for _ in range(6)]
            counts = [0] * 6

            def seen(i: int, tokens) -> None:
                counts[i] += len(tokens)
                if counts[i] >= 2:
                    streaming[i].set()

            calls = [asyncio.create_task(generate(
                cluster.router_address, request_to_pb(token_ids=[i + 1, 2, 3], params=long),
                timeout_s=60, on_tokens=lambda tokens, i=i: seen(i, tokens)))
                for i in range(6)]
            # every request past decode's first tokens (the first came from prefill, and a
            # failure right after it is retried elsewhere), so none can be retried
            await asyncio.wait_for(asyncio.gather(*(seen.wait() for seen in streaming)), 30)
            on_victim = (await worker_load(decode[0].address, "decode",
                                           cluster.internal_token)).running
            decode[0].popen.send_signal(signal.SIGKILL)
            # the requests on the killed worker fail; tokens it sent before the kill may still
            # be on their way, so count endings, not tokens
            deadline = time.monotonic() + 60
            while sum(c.done() for c in calls) < on_victim:
                assert time.monotonic() < deadline, (on_victim, [c.done() for c in calls])
                await asyncio.sleep(0.05)
            # the others carry on: 20 more tokens each after those failures (decoding their
            # 2,000 tokens to the end would only take time), then they are stopped
            survivors = [i for i, c in enumerate(calls) if not c.done()]
            at_failures = list(counts)
            while not all(counts[i] >= at_failures[i] + 20 for i in survivors):
                assert time.monotonic() < deadline, (counts, at_failures)
                await asyncio.sleep(0.05)
            for i in survivors:
                calls[i].cancel()
            results = await asyncio.gather(*calls, return_exceptions=True)
            return [r for i, r in enumerate(results) if i not in survivors], survivors, on_victim

        failed, survivors, on_victim = asyncio.run(scenario())
        assert on_victim > 0 and len(failed) == on_victim  # each request of the killed worker
        assert survivors, "some requests ran on the other worker and carried on"
        for exc in failed:
            assert isinstance(exc, grpc.aio.AioRpcError)
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert decode[0].address in exc.details()
        # new requests go to the surviving worker
        prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
        outs = asyncio.run(generate_all(cluster.router_address, prompts))
        assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), prompts)
