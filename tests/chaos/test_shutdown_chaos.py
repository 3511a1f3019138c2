"""Finding 9: SIGTERM lets running requests finish for --grace seconds, then ends the rest with
finish reason ABORT and a status that says the server is shutting down.

Real processes on 127.0.0.1: `flashsplit up --grace 1` with one prefill and one decode worker of
the built-in model. First a decode worker gets SIGTERM (and `up` restarts it), then `up` itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from common.convert import finish_reason_from_pb
from common.model.load import load_model
from common.pb.flashsplit.v1 import generation_pb2_grpc
from common.sampling import SamplingParams
from router.remote import request_to_pb
from tests.chaos.up_process import UpProcess, generate_until_served, wait_pools_free
from tests.router.test_end_to_end import local_greedy

GRACE = 1.0
PROMPTS = [[3, 4, 5], [(11 * j) % 256 for j in range(21)]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
# far longer than the grace: it is still running when the grace is over
LONG = SamplingParams(temperature=0.0, max_new_tokens=3000, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
UP_ARGS = ("--quiet", "--model", "tiny", "--page-size", "4", "--num-pages", "2048", "--num-slots", "9",
           "--grace", str(GRACE))


@pytest.fixture(scope="module")
def up():
    process = UpProcess(UP_ARGS)
    try:
        yield process.start(workers=2)
    finally:
        process.stop()


async def stream(address: str, params: SamplingParams, tokens_before: asyncio.Event | None = None,
                 at_least: int = 5):
    """Generate, keeping every message: (token count, finish reasons, status, details, end);
    ``tokens_before`` is set once ``at_least`` tokens came."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(
            request_to_pb(token_ids=[1, 2, 3], params=params), timeout=60)
        tokens, reasons = 0, []
        try:
            async for msg in call:
                tokens += len(msg.token_ids)
                reasons.append(finish_reason_from_pb(msg.finish_reason))
                if tokens_before is not None and tokens >= at_least:
                    tokens_before.set()
            code, details = await call.code(), await call.details()
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details()
        return tokens, [r for r in reasons if r], code, details, time.monotonic()


def test_sigterm_on_a_decode_worker_ends_its_streams_with_abort_after_the_grace(up):
    expected = local_greedy(load_model("tiny"), PROMPTS, GREEDY)
    start = wait_pools_free(up.router_address)

    async def scenario():
        streaming = asyncio.Event()
        long = asyncio.ensure_future(stream(up.router_address, LONG, streaming))
        await asyncio.wait_for(streaming.wait(), 20)
        at = time.monotonic()
        os.kill(up.pids["decode-0"], signal.SIGTERM)
        return at, await asyncio.wait_for(long, 30)

    at, (tokens, reasons, code, details, end) = asyncio.run(scenario())
    assert reasons == ["abort"] and code == grpc.StatusCode.OK, (reasons, code, details)
    assert 5 <= tokens < LONG.max_new_tokens
    assert GRACE - 0.1 <= end - at < GRACE + 3
    # it exited by itself (status 0) and `up` put it back
    up.wait_for_line(r"^warning: decode-0 \(\S+\) exited with status 0;", 15, at)
    up.note_restart("decode-0", at)
    outs = generate_until_served(up.router_address, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert wait_pools_free(up.router_address) == start


def test_sigterm_on_up_finishes_short_requests_and_aborts_long_ones_after_the_grace(up):
    wait_pools_free(up.router_address)

    async def once(params: SamplingParams):
        async with grpc.aio.insecure_channel(up.router_address) as channel:
            try:
                await generation_pb2_grpc.GenerationStub(channel).GenerateOnce(
                    request_to_pb(token_ids=[4, 5], params=params), timeout=60)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            return grpc.StatusCode.OK, ""

    async def scenario():
        streaming = asyncio.Event()
        long = asyncio.ensure_future(stream(up.router_address, LONG, streaming))
        long_once = asyncio.ensure_future(once(LONG))
        await asyncio.wait_for(streaming.wait(), 20)
        started = asyncio.Event()
        short = asyncio.ensure_future(stream(up.router_address, SHORT, started, at_least=1))
        # the short one is in flight too, past its prefill (on a loaded machine a prefill may
        # not start within the grace)
        await asyncio.wait_for(started.wait(), 20)
        at = time.monotonic()
        up.proc.send_signal(signal.SIGTERM)
        return at, await asyncio.wait_for(asyncio.gather(long, long_once, short), 30)

    at, (long, long_once, short) = asyncio.run(scenario())
    tokens, reasons, code, details, end = long
    # the last message says ABORT, the status says why
    if reasons != ["abort"]:
        print(up.output())  # shown in full with the failure: which process stopped when
    assert reasons == ["abort"], (reasons, code, details)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert details == f"router shutting down: the request was aborted after {tokens} tokens"
    assert GRACE - 0.1 <= end - at < GRACE + 3
    assert long_once[0] == grpc.StatusCode.UNAVAILABLE
    assert long_once[1].startswith("router shutting down: the request was aborted after ")
    # a request that fits in the grace completes as usual
    assert short[:3] == (SHORT.max_new_tokens, ["length"], grpc.StatusCode.OK)
    assert up.proc.wait(timeout=20) == 0
