"""common/shutdown.py: stop taking calls, let running ones finish for the grace, then end the
rest with a status that says the server is shutting down."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_util import set_serving
from common.pb.flashsplit.v1 import types_pb2
from common.shutdown import stop_gracefully
from tests.common.toy_service import start_toy, stub

GRACE = 0.6
FINAL = 0.4


def request(n: int) -> types_pb2.AbortRequest:
    return types_pb2.AbortRequest(handoff_id=n)


async def collect(call) -> tuple[list[bool], grpc.StatusCode, str]:
    """The messages of a stream, with the status it ended with."""
    found = []
    try:
        async for msg in call:
            found.append(msg.found)
    except grpc.aio.AioRpcError as exc:
        return found, exc.code(), exc.details()
    return found, await call.code(), await call.details()


def test_calls_get_the_grace_then_end_with_a_clear_status():
    async def scenario():
        server, toy, address, health = await start_toy(final_s=FINAL)
        await set_serving(health, [], True)
        async with grpc.aio.insecure_channel(address) as channel:
            quick = asyncio.ensure_future(stub(channel, "Sleep", "uu")(request(200), timeout=10))
            slow = asyncio.ensure_future(stub(channel, "Sleep", "uu")(request(60_000), timeout=60))
            aware = asyncio.ensure_future(collect(stub(channel, "Ticks", "us")(request(10_000))))
            blind = asyncio.ensure_future(
                collect(stub(channel, "BlindTicks", "us")(request(10_000))))
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(0.1)  # all four are running
            start = time.monotonic()
            stopping = asyncio.ensure_future(stop_gracefully(server, health, toy.shutdown, GRACE))
            status = await asyncio.wait_for(watch.read(), 5)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub(channel, "Sleep", "uu")(request(1), timeout=5)
            assert (await quick).found  # finished within the grace
            ticks, aware_code, _ = await aware
            aware_at = time.monotonic() - start
            with pytest.raises(grpc.aio.AioRpcError) as slow_err:
                await slow
            blind_ticks, blind_code, blind_details = await blind
            await stopping
            stopped_at = time.monotonic() - start
        return (status.status, refused.value, ticks, aware_code, aware_at, slow_err.value,
                blind_ticks, blind_code, blind_details, stopped_at, toy)

    (health, refused, ticks, aware_code, aware_at, slow, blind_ticks, blind_code, blind_details,
     stopped_at, toy) = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING
    # no new call once draining: gRPC answers UNAVAILABLE, or CANCELLED when the call's stream
    # opened before the client read the server's GOAWAY (gRPC's race, not a status of ours)
    assert refused.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    # the shutdown-aware stream sent its own last message when the grace was over
    assert ticks[-1] is False and all(ticks[:-1]) and len(ticks) > 5
    assert aware_code == grpc.StatusCode.OK and GRACE <= aware_at < GRACE + FINAL
    # the others were ended after the final moment, with a status that says why
    for code, details in ((slow.code(), slow.details()), (blind_code, blind_details)):
        assert code == grpc.StatusCode.UNAVAILABLE
        assert details == "toy server shutting down"
    assert blind_ticks and all(blind_ticks)
    assert "sleep" in toy.cleaned_up and "ticks" in toy.cleaned_up  # their finally blocks ran
    assert GRACE + FINAL <= stopped_at < GRACE + FINAL + 1.5


def test_a_server_with_nothing_running_stops_at_once():
    async def scenario():
        server, toy, address, health = await start_toy()
        async with grpc.aio.insecure_channel(address) as channel:
            assert (await stub(channel, "Sleep", "uu")(request(1), timeout=5)).found
        start = time.monotonic()
        await stop_gracefully(server, health, toy.shutdown, grace=30)
        return time.monotonic() - start, toy.shutdown.expired.is_set()

    elapsed, expired = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert elapsed < 2 and not expired
