"""The router's metrics as served: ``GET /metrics`` on the HTTP API (no API key, as /health) and
``--metrics-port``, against an in-process router and fake workers; how requests that complete,
fail, are cancelled or are rejected are counted."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from common.auth import MetadataCheck
from common.pb.flashsplit.v1 import generation_pb2_grpc
from common.sampling import SamplingParams
from common.security import ServerSecurity
from router.dispatch import DispatchConfig
from router.openai_api.config import HttpConfig
from router.registry import RegistryConfig
from router.remote import request_to_pb
from router.server import Router, RouterConfig
from tests.common.metrics.scrape import Scrape
from tests.router.fakes import REPLY_IDS, start_fake

KEY = "k" * 32
R = "flashsplit_router"
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


async def serving(body):
    """Run ``body(router, http, stub, decode)`` against fakes and a router that serves HTTP
    (API key required) and a metrics port."""
    prefill, decode = await start_fake("prefill"), await start_fake("decode")
    router = Router(RouterConfig(
        model="tiny", prefill=(prefill.address,), decode=(decode.address,),
        registry=RegistryConfig(poll_interval_s=0.05, poll_timeout_s=2.0,
                                backoff_initial_s=0.05, backoff_max_s=0.1),
        dispatch=DispatchConfig(max_attempts=1),
        public=ServerSecurity(check=MetadataCheck.api_key(KEY)), http=HttpConfig(),
        metrics_port=0))
    await router.start()
    channel = grpc.aio.insecure_channel(router.address)
    try:
        async with httpx.AsyncClient(base_url=f"http://{router.http_address}", timeout=10) as http:
            await until_healthy(http)
            await body(router, http, generation_pb2_grpc.GenerationStub(channel),
                       decode.servicer)
    finally:
        await channel.close()
        await router.stop(0)
        await prefill.stop()
        await decode.stop()


async def until_healthy(http: httpx.AsyncClient) -> None:
    """Until the router has a healthy pair (the fakes answered a poll)."""
    while (await http.get("/health")).status_code != 200:
        await asyncio.sleep(0.02)


def run(body):
    asyncio.run(asyncio.wait_for(serving(body), 30))


async def scrape(http: httpx.AsyncClient) -> Scrape:
    resp = await http.get("/metrics")  # no Authorization header
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return Scrape(resp.text)


def call(stub, prompt, params=PARAMS):
    return stub.Generate(request_to_pb(token_ids=prompt, params=params),
                         metadata=(("authorization", f"Bearer {KEY}"),), timeout=10)


async def drain(stream) -> list:
    return [msg async for msg in stream]


def test_http_metrics_need_no_key_and_count_completed_and_rejected_requests():
    async def body(router, http, stub, decode):
        assert (await http.get("/v1/models")).status_code == 401  # the key guards the rest
        await drain(call(stub, [1, 2, 3]))
        resp = await http.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 8},
                               headers={"authorization": f"Bearer {KEY}"})
        assert resp.status_code == 200, resp.text
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await drain(call(stub, [10 ** 6]))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        s = await scrape(http)
        assert s.value(f"{R}_requests_total", finish_reason="length", status="OK") == 2
        assert s.value(f"{R}_requests_total", finish_reason="none",
                       status="INVALID_ARGUMENT") == 1
        assert s.value(f"{R}_time_to_first_token_seconds_count") == 2
        assert s.value(f"{R}_inter_token_latency_seconds_count") == 2 * (8 - 1)
        assert s.value(f"{R}_generation_tokens_total") == 16
        assert s.value(f"{R}_prompt_tokens_total") == 5
        # the metrics port serves the same registry, from its own thread
        port = await asyncio.to_thread(httpx.get, f"http://{router.metrics_address}/metrics")
        assert Scrape(port.text).value(f"{R}_requests_total") == 3

    run(body)


def test_failed_and_cancelled_requests_count_by_status_and_leave_nothing_running():
    async def body(router, http, stub, decode):
        decode.knobs.break_after = 2
        with pytest.raises(grpc.aio.AioRpcError) as broken:
            await drain(call(stub, [1, 2]))
        assert broken.value.code() == grpc.StatusCode.UNAVAILABLE
        decode.knobs.break_after = None
        await until_healthy(http)  # the failure marked the decode worker down for a moment
        decode.knobs.event_delay_s = 0.05
        stream = call(stub, [3], SamplingParams(temperature=0.0,
                                                max_new_tokens=len(REPLY_IDS)))
        await stream.read()
        s = await scrape(http)
        assert s.value(f"{R}_running_requests") == 1
        stream.cancel()
        for _ in range(200):
            s = await scrape(http)
            if s.value(f"{R}_requests_total", status="CANCELLED") == 1:
                break
            await asyncio.sleep(0.01)
        assert s.value(f"{R}_requests_total", finish_reason="none", status="UNAVAILABLE") == 1
        assert s.value(f"{R}_requests_total", finish_reason="none", status="CANCELLED") == 1
        assert s.value(f"{R}_running_requests") == 0
        assert s.value(f"{R}_waiting_requests") == 0
        # neither completed: no latencies recorded, but their tokens are counted
        assert s.value(f"{R}_e2e_request_latency_seconds_count") == 0
        assert s.value(f"{R}_generation_tokens_total") >= 3

    run(body)
