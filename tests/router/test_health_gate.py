"""The router sends no work to a worker whose grpc.health.v1 says NOT_SERVING, and takes it
back once it says SERVING again (fake workers on 127.0.0.1, an in-process router)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.grpc_util import SERVER_OPTIONS, set_serving
from common.pb.flashsplit.v1 import decode_pb2_grpc, generation_pb2_grpc
from router.client import WorkerCallError, WorkerClients
from router.registry import RegistryConfig
from router.remote import request_to_pb
from router.server import Router, RouterConfig
from tests.router.fakes import FakeDecode, start_fake


async def decode_with_health():
    """A fake decode worker that also serves grpc.health.v1; returns (server, fake, health)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    fake = FakeDecode()
    decode_pb2_grpc.add_DecodeServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    await set_serving(health_servicer, [], True)
    return server, fake, health_servicer


def test_get_load_fails_for_a_worker_that_is_not_serving():
    async def scenario():
        server, fake, health_servicer = await decode_with_health()
        clients = WorkerClients()
        try:
            report = await clients.get_load(fake.address, "decode")
            await set_serving(health_servicer, [], False)
            with pytest.raises(WorkerCallError) as err:
                await clients.get_load(fake.address, "decode")
            return report, err.value
        finally:
            await clients.close()
            await server.stop(0)

    report, err = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert report.kind == "decode" and report.free_slots == 8
    assert err.code == grpc.StatusCode.UNAVAILABLE and "health is NOT_SERVING" in str(err)


def test_requests_avoid_a_not_serving_decode_worker_until_it_serves_again():
    async def scenario():
        prefill = await start_fake("prefill")
        servers = [await decode_with_health() for _ in range(2)]
        (_, draining, draining_health), (_, serving, _) = servers
        await set_serving(draining_health, [], False)  # e.g. it got SIGTERM and drains
        router = Router(RouterConfig(
            model="tiny", prefill=(prefill.address,),
            decode=(draining.address, serving.address),
            registry=RegistryConfig(poll_interval_s=0.05, backoff_initial_s=0.05,
                                    backoff_max_s=0.1)))
        address = await router.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)

                async def run_some(n):
                    for i in range(n):
                        req = request_to_pb(token_ids=[1, 2 + i])
                        assert [m async for m in stub.Generate(req, timeout=10)]

                await run_some(8)
                avoided = (len(draining.handoffs), len(serving.handoffs))
                await set_serving(draining_health, [], True)
                await asyncio.sleep(0.5)  # a few polls: it is back in rotation
                before = len(draining.handoffs)
                await run_some(8)
                return avoided, len(draining.handoffs) - before
        finally:
            await router.stop(0)
            await prefill.stop()
            for server, _, _ in servers:
                await server.stop(0)

    (on_draining, on_serving), back = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert on_draining == 0 and on_serving == 8
    assert back > 0
