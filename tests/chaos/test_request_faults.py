"""Client behaviour that used to end worker engines: deadlines, cancellations, tiny temperatures.

Real processes on 127.0.0.1 (router, two prefill workers, a decode worker). After each fault the
cluster must serve exact greedy output and every pool must be back to its starting free counts.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from common.model.load import load_model
from common.sampling import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.router.test_end_to_end import PAGE, local_greedy, wait_all_free, worker_load

PROMPTS = [[3, 4, 5], [(11 * j) % 256 for j in range(21)]]


@pytest.fixture(scope="module")
def cluster():
    # room for the whole burst at once: a full pool is another test's subject
    worker_args = ("--page-size", str(PAGE), "--num-pages", "2048", "--num-slots", "48")
    config = ClusterConfig(model="tiny", num_prefill=2, num_decode=1, worker_args=worker_args,
                           router_args=("--poll-interval", "0.2"))
    with Cluster(config) as cluster:
        yield cluster


def pool_counts(cluster) -> list[tuple[int, int]]:
    return [(r.free_pages, r.free_slots) for r in asyncio.run(wait_all_free(cluster))]


def run_prompts(cluster, params: SamplingParams):
    async def all_of_them():
        return await asyncio.gather(*[
            generate(cluster.router_address, request_to_pb(token_ids=p, params=params))
            for p in PROMPTS])

    return asyncio.run(all_of_them())


def assert_serves_exact_greedy(cluster) -> None:
    outs = run_prompts(cluster, SamplingParams(temperature=0.0, max_new_tokens=12,
                                               ignore_eos=True))
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS)


def test_deadlines_and_cancellations_end_only_their_requests(cluster):
    start = pool_counts(cluster)
    rng = random.Random(0)
    long = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)

    async def one(i: int):
        prompt = [(i * 13 + j) % 256 for j in range(rng.randint(1, 90))]
        return await generate(cluster.router_address, request_to_pb(token_ids=prompt, params=long),
                              timeout_s=rng.uniform(0.01, 0.3))

    async def burst():
        return await asyncio.gather(*[one(i) for i in range(40)], return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(burst(), 60))
    codes = {r.code() for r in results if isinstance(r, grpc.aio.AioRpcError)}
    assert codes <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}, codes
    assert codes, "no deadline fell mid-request: the burst shows nothing"
    for w in cluster.workers:  # every engine still up: a dead one answers UNAVAILABLE
        assert asyncio.run(worker_load(w.address, w.kind, cluster.internal_token)).total_pages > 0
    assert pool_counts(cluster) == start
    assert_serves_exact_greedy(cluster)


@pytest.mark.parametrize("temperature", [1e-300, 1e-39, 5e-6])
def test_tiny_temperatures_are_greedy_through_the_split(cluster, temperature):
    start = pool_counts(cluster)
    params = SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=12,
                            ignore_eos=True, seed=3)
    outs = run_prompts(cluster, params)
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS)
    assert pool_counts(cluster) == start
    assert_serves_exact_greedy(cluster)
