"""Finding 7: hostile requests get INVALID_ARGUMENT with a clear message, and cost nothing.

Real processes on 127.0.0.1 (`Cluster`: router, a prefill and a decode worker of the built-in
model, 63 usable pages of 4 tokens each). Each request below is a caller's mistake: too many stop
ids, an oversized request id, prompt or message, a generation that no pool could ever hold,
bytes that are not a protobuf message, text that is not UTF-8. Each gets INVALID_ARGUMENT, at the
router and (sent to them directly) at the workers. Afterwards the cluster serves exact greedy
output and every pool is back to its starting free counts.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.handoff.payload import new_handoff_id
from common.model.load import load_model
from common.pb.flashsplit.v1 import prefill_pb2, prefill_pb2_grpc
from common.sampling import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.router.test_end_to_end import local_greedy, wait_all_free

PAGE, PAGES = 4, 64
CAPACITY = (PAGES - 1) * PAGE  # token positions of one request with every page free
WORKER_ARGS = ("--page-size", str(PAGE), "--num-pages", str(PAGES), "--num-slots", "9")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
PROMPTS = [[3, 4, 5], [(11 * j) % 256 for j in range(21)]]
INVALID = grpc.StatusCode.INVALID_ARGUMENT
GENERATE = "/flashsplit.v1.Generation/Generate"


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(model="tiny", worker_args=WORKER_ARGS,
                           router_args=("--poll-interval", "0.2"))
    with Cluster(config) as cluster:
        yield cluster


def pools(cluster) -> list[tuple[int, int]]:
    return [(r.free_pages, r.free_slots) for r in asyncio.run(wait_all_free(cluster))]


def refusal(coro_fn) -> grpc.aio.AioRpcError:
    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(coro_fn(), 30)
        return err.value

    return asyncio.run(run())


def params(**kw) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=0.0, max_new_tokens=4, ignore_eos=True), **kw})


HOSTILE = {
    "2000 distinct stop ids": (
        dict(token_ids=[1, 2], params=params(stop_token_ids=range(2000))),
        "at most 1024 distinct stop_token_ids are accepted, got 2000"),
    "a 300-byte request id": (
        dict(token_ids=[1, 2], params=params(), request_id="é" * 150),
        "request_id may have at most 256 bytes, got 300"),
    "a 1 MiB request id": (
        dict(token_ids=[1, 2], params=params(), request_id="r" * (1 << 20)),
        "request_id may have at most 256 bytes"),
    "a prompt longer than any prefill pool": (
        dict(token_ids=[7] * (CAPACITY + 1), params=params()),
        f"the prompt has {CAPACITY + 1} tokens; the largest prefill worker holds {CAPACITY}"),
    "max_new_tokens no decode pool can ever hold": (
        dict(token_ids=[1, 2, 3], params=params(max_new_tokens=5000)),
        f"needs 5003 token positions; the largest decode worker holds {CAPACITY}"),
    "a text prompt beyond --max-prompt-bytes": (
        dict(text="x" * (3 << 20), params=params()),
        "at most 2097152 are accepted (--max-prompt-bytes)"),
    "a message beyond --max-message-bytes": (
        dict(text="x" * (5 << 20), params=params()),
        "at most 4194304 are accepted"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_requests_are_invalid_argument_at_the_router(cluster, case):
    request, message = HOSTILE[case]
    err = refusal(lambda: generate(cluster.router_address, request_to_pb(**request)))
    assert err.code() == INVALID and message in err.details(), err.details()[:300]
    assert len(err.details()) < 1000  # no echo of what was sent


@pytest.mark.parametrize("data, what", [
    (b"\x0a\xff\xff\xff", "truncated"),
    (b"\x12\x03\xff\xfe\xfd", "text that is not UTF-8"),
])
def test_bytes_that_are_no_request_are_invalid_argument(cluster, data, what):
    async def send():
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            return [m async for m in channel.unary_stream(GENERATE)(data, timeout=10)]

    err = refusal(send)
    assert err.code() == INVALID, (what, err)
    assert "not a valid protobuf message" in err.details() and GENERATE in err.details()


def test_duplicate_stop_ids_are_collapsed_not_refused(cluster):
    # 100,000 copies of one id weigh 100 kB on the wire but are one stop id to the engine
    stop = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(3,) * 100_000,
                          ignore_eos=True)
    out = asyncio.run(generate(cluster.router_address,
                               request_to_pb(token_ids=PROMPTS[1], params=stop), timeout_s=30))
    ref = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(3,),
                         ignore_eos=True)
    assert out.token_ids == local_greedy(load_model("tiny"), [PROMPTS[1]], ref)[0]


@pytest.mark.parametrize("change, message", [
    (dict(sampling=dict(stop_token_ids=list(range(1500)))), "at most 1024 distinct"),
    (dict(request_id="q" * 257), "request_id may have at most 256 bytes, got 257"),
    (dict(prompt_token_ids=[5] * (CAPACITY + 1)), f"pool holds at most {CAPACITY}"),
])
def test_a_prefill_worker_checks_the_same_limits(cluster, change, message):
    prefill = next(w for w in cluster.workers if w.kind == "prefill")
    decode = next(w for w in cluster.workers if w.kind == "decode")
    request = prefill_pb2.PrefillRequest(handoff_id=new_handoff_id(), prompt_token_ids=[1, 2],
                                         decode_address=decode.address)
    request.sampling.max_new_tokens = 4
    for key, value in change.items():
        if key == "sampling":
            request.sampling.stop_token_ids.extend(value["stop_token_ids"])
        elif key == "prompt_token_ids":
            del request.prompt_token_ids[:]
            request.prompt_token_ids.extend(value)
        else:
            setattr(request, key, value)

    async def send():
        async with cluster.worker_channel(prefill.address) as channel:
            async for _ in prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=10):
                pass

    err = refusal(send)
    assert err.code() == INVALID and message in err.details(), err.details()[:300]


def test_after_the_hostile_requests_the_cluster_serves_exact_greedy_with_pools_free(cluster):
    start = pools(cluster)
    assert all(free == (CAPACITY // PAGE, 8) for free in start), start

    async def both():
        return await asyncio.gather(*[
            generate(cluster.router_address, request_to_pb(token_ids=p, params=GREEDY))
            for p in PROMPTS])

    outs = asyncio.run(both())
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS, GREEDY)
    assert pools(cluster) == start
