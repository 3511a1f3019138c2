"""Admission faults: header-only handoffs that would hold decode's room, oversized claims, and
a burst of requests beyond the slots of the decode worker.

Real processes on 127.0.0.1. After each fault the cluster serves exact greedy output and every
pool is back to its starting free counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest

from common import convert
from common.channels import ChannelSecurity, make_channel
from common.handoff.manifest import FieldSpec
from common.handoff.stream import header_of
from common.model.load import load_model
from common.pb.flashsplit.v1 import decode_pb2_grpc
from common.sampling import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.chaos.test_auth_chaos import forged_payload
from tests.router.test_end_to_end import PAGE, local_greedy, wait_all_free

IDLE_S = 1.0
SLOTS = 4  # usable decode slots (the pool has one more, the scratch slot)


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(
        model="tiny", worker_args=("--page-size", str(PAGE), "--num-pages", "512"),
        decode_args=("--num-slots", str(SLOTS + 1), "--handoff-idle-timeout", str(IDLE_S)),
        router_args=("--poll-interval", "0.2"))
    with Cluster(config) as cluster:
        yield cluster


def counts(cluster):
    return [(r.free_pages, r.free_slots) for r in asyncio.run(wait_all_free(cluster))]


def decode_address(cluster) -> str:
    return next(w.address for w in cluster.workers if w.kind == "decode")


def test_header_only_handoffs_are_released_after_the_idle_timeout(cluster):
    start = counts(cluster)
    fingerprint = asyncio.run(fingerprint_of(cluster))

    async def hold(channel):
        call = decode_pb2_grpc.DecodeStub(channel).Handoff(timeout=30)
        header = header_of(forged_payload(fingerprint))
        await call.write(convert.handoff_part_to_pb(header))
        assert (await call.read()).WhichOneof("reply") == "accepted"
        began = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # then send nothing at all
            await call.read()
        return err.value.code(), time.monotonic() - began

    async def scenario():
        security = ChannelSecurity.internal(cluster.internal_token)
        async with make_channel(decode_address(cluster), security) as channel:
            return await asyncio.gather(*[hold(channel) for _ in range(SLOTS)])

    results = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert all(code == grpc.StatusCode.DEADLINE_EXCEEDED for code, _ in results), results
    assert all(IDLE_S - 0.2 <= waited < IDLE_S + 3 for _, waited in results), results
    assert counts(cluster) == start
    assert_serves(cluster)


def test_a_header_claiming_fields_decode_has_no_place_for_is_refused(cluster):
    start = counts(cluster)
    fingerprint = asyncio.run(fingerprint_of(cluster))
    header = header_of(forged_payload(fingerprint))
    huge = dataclasses.replace(header, manifest={
        **header.manifest, "top_k": FieldSpec("float32", (1 << 20, 1 << 10))})

    async def send():
        security = ChannelSecurity.internal(cluster.internal_token)
        async with make_channel(decode_address(cluster), security) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).Handoff(timeout=10)
            await call.write(convert.handoff_part_to_pb(huge))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            return err.value

    err = asyncio.run(send())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_k" in err.details()
    assert counts(cluster) == start


def test_a_burst_beyond_the_decode_slots_waits_for_room_and_completes(cluster):
    start = counts(cluster)
    prompts = [[(5 * i + j) % 256 for j in range(3 + i % 7)] for i in range(3 * SLOTS)]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)

    async def burst():
        return await asyncio.gather(*[
            generate(cluster.router_address, request_to_pb(token_ids=p, params=params),
                     timeout_s=60) for p in prompts])

    outs = asyncio.run(asyncio.wait_for(burst(), 90))
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), prompts, params)
    assert counts(cluster) == start


def assert_serves(cluster) -> None:
    prompts = [[3, 4, 5], [9] * 11]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)

    async def both():
        return await asyncio.gather(*[
            generate(cluster.router_address, request_to_pb(token_ids=p, params=params))
            for p in prompts])

    outs = asyncio.run(both())
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), prompts, params)


async def fingerprint_of(cluster) -> str:
    from tests.router.test_end_to_end import worker_load

    report = await worker_load(decode_address(cluster), "decode", cluster.internal_token)
    return report.model_fingerprint
