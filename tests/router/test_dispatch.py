"""The dispatcher's first token: streamed from the prefill worker before the handoff lands, skipped
in decode's stream, and carried into a retry when the attempt fails after it."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from common.pb.flashsplit.v1 import generation_pb2_grpc
from router.dispatch import DispatchConfig
from router.registry import RegistryConfig
from router.server import Router, RouterConfig
from tests.router.fakes import REPLY_IDS, start_fake
from tests.router.test_server import collect, request

SC = grpc.StatusCode


@contextlib.asynccontextmanager
async def cluster(num_prefill=1, first_token_from_prefill=True):
    prefills = [await start_fake("prefill") for _ in range(num_prefill)]
    decode = await start_fake("decode")
    router = Router(RouterConfig(
        model="tiny", prefill=tuple(w.address for w in prefills), decode=(decode.address,),
        registry=RegistryConfig(poll_interval_s=0.05, poll_timeout_s=2.0,
                                backoff_initial_s=30.0, backoff_max_s=60.0),
        dispatch=DispatchConfig(max_attempts=3,
                                first_token_from_prefill=first_token_from_prefill)))
    address = await router.start()
    channel = grpc.aio.insecure_channel(address)
    try:
        yield (generation_pb2_grpc.GenerationStub(channel), [w.servicer for w in prefills],
               decode.servicer)
    finally:
        await channel.close()
        await router.stop(0)
        for w in prefills + [decode]:
            await w.stop()


async def first_message_and_handoffs(stub, decode, max_new_tokens=6):
    """The first streamed message, the handoffs decode had when it came, and the rest."""
    call = stub.Generate(request(ids=[5, 6, 7], max_new_tokens=max_new_tokens), timeout=5)
    first = await call.read()
    seen = len(decode.handoffs)
    rest = []
    while (m := await call.read()) is not grpc.aio.EOF:
        rest.append(m)
    return first, seen, rest


@pytest.mark.parametrize("from_prefill", [True, False])
def test_the_first_token_comes_before_the_handoff_lands_unless_told_otherwise(from_prefill):
    async def body():
        async with cluster(first_token_from_prefill=from_prefill) as (stub, (prefill,), decode):
            prefill.knobs.handoff_delay_s = 0.3
            first, handoffs_then, rest = await first_message_and_handoffs(stub, decode)
            assert tuple(first.token_ids) == REPLY_IDS[:1]
            assert handoffs_then == (0 if from_prefill else 1)
            # decode's stream starts with the same token: the client gets it once
            tokens = [*first.token_ids, *(t for m in rest for t in m.token_ids)]
            assert tuple(tokens) == REPLY_IDS[:6]
            assert len(rest[-1].timings.inter_token_latencies_s) == 5
    asyncio.run(body())


def test_an_attempt_that_fails_after_its_early_token_is_retried_after_that_token():
    async def body():
        async with cluster(num_prefill=2) as (stub, prefills, decode):
            prefills[0].knobs.fail_after_first_token = 1
            prefills[1].knobs.queue_len = 5  # so the failing worker is chosen first
            await asyncio.sleep(0.15)  # let the registry see the queue
            msgs = await collect(stub, request(ids=[5, 6, 7], max_new_tokens=6))
            calls = prefills[0].calls + prefills[1].calls
            assert len(calls) == 2
            # the retry's prompt ends with the token the client already has, and asks one less
            assert list(calls[1].prompt_token_ids) == [5, 6, 7, REPLY_IDS[0]]
            assert calls[1].sampling.max_new_tokens == 5
            tokens = [t for m in msgs for t in m.token_ids]
            # the fakes answer every prompt with REPLY_IDS: the retry's start follows the first
            assert tokens == [REPLY_IDS[0], *REPLY_IDS[:5]]
            assert len(decode.handoffs) == 1  # the failed attempt never handed off
    asyncio.run(body())


def test_decode_starting_with_another_token_is_an_internal_error():
    async def body():
        async with cluster() as (stub, (prefill,), _):
            prefill.knobs.early_token = REPLY_IDS[0] + 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request(ids=[5, 6, 7], max_new_tokens=6))
            assert err.value.code() == SC.INTERNAL
            assert "the prefill worker sampled" in err.value.details()
    asyncio.run(body())


def test_a_request_that_ends_at_its_first_token_gets_it_once():
    async def body():
        async with cluster() as (stub, (prefill,), decode):
            msgs = await collect(stub, request(ids=[5, 6, 7], max_new_tokens=1))
            assert [t for m in msgs for t in m.token_ids] == [REPLY_IDS[0]]
            assert msgs[-1].finish_reason and not decode.handoffs
    asyncio.run(body())


def test_logprobs_of_the_early_token_are_not_repeated():
    async def body():
        async with cluster() as (stub, (prefill,), decode):
            req = request(ids=[5, 6, 7], max_new_tokens=4, logprobs=2)
            msgs = await collect(stub, req)
            tokens = [t for m in msgs for t in m.token_ids]
            logprobs = [lp for m in msgs for lp in m.logprobs]
            assert tuple(tokens) == REPLY_IDS[:4] and len(logprobs) == 4
    asyncio.run(body())
