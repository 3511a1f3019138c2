"""Worker targets and DNS discovery: a fake resolver adds and removes addresses, and the
registry (alone, then inside a router in front of fake workers on 127.0.0.1) follows."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from common.grpc_util import set_serving
from common.load_report import LoadReport
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc
from common.security import TOKEN_ENV
from router.__main__ import build_parser, config_from_args
from router.discovery import (DiscoveryConfig, SystemResolver, WorkerDiscovery, WorkerTarget,
                              parse_target, parse_targets)
from router.registry import RegistryConfig, WorkerRegistry
from router.remote import request_to_pb
from router.server import Router, RouterConfig
from tests.router.fakes import REPLY_IDS, start_fake
from tests.router.test_health_gate import decode_with_health


class FakeResolver:
    """answers[name]: the addresses it resolves to, or an OSError to raise."""

    def __init__(self, answers):
        self.answers = answers
        self.asked = []

    async def resolve(self, host, port):
        self.asked.append((host, port))
        answer = self.answers[host]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


async def wait_for(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- targets ----------------------------------------------------------------------------------

def test_targets_parse_fixed_addresses_and_dns_names():
    assert parse_target("10.0.0.1:50061", "prefill") == WorkerTarget("prefill", "10.0.0.1", 50061)
    assert parse_target("[::1]:7", "decode").address == "[::1]:7"
    name = parse_target("dns:///flashsplit-decode:50062", "decode")
    assert (name.host, name.port, name.dns) == ("flashsplit-decode", 50062, True)
    assert str(name) == "dns:///flashsplit-decode:50062"
    for bad in ("10.0.0.1", "host:", "host:0", "host:65536", "host:x", ":5",
                "dns://8.8.8.8/name:5", "dns:name:5", "dns:///name"):
        with pytest.raises(ValueError):
            parse_target(bad, "prefill")
    with pytest.raises(ValueError, match="listed twice"):
        parse_targets(["a:1", "dns:///n:1"], ["a:1"])
    assert len(parse_targets(["dns:///n:1"], ["dns:///n:1"])) == 2  # sorted out per address


def test_router_flags_take_dns_targets_and_the_interval():
    def config(*argv):
        return config_from_args(build_parser().parse_args(list(argv)), {TOKEN_ENV: "t" * 32})

    c = config("--prefill", "dns:///p:50061", "--prefill", "10.0.0.9:50061",
               "--decode", "dns:///d:50062", "--discovery-interval", "2.5")
    assert c.prefill == ("dns:///p:50061", "10.0.0.9:50061") and c.discovery.interval_s == 2.5
    with pytest.raises(ValueError, match="dns:///NAME:PORT"):
        config("--prefill", "dns://p:50061", "--decode", "d:1")
    with pytest.raises(ValueError, match="discovery interval"):
        config("--prefill", "p:1", "--decode", "d:1", "--discovery-interval", "0")


# -- the system resolver ----------------------------------------------------------------------

def test_system_resolver_reads_the_hosts_file_and_tells_no_name_from_no_answer(monkeypatch):
    found = asyncio.run(SystemResolver().resolve("localhost", 50061))
    assert "127.0.0.1:50061" in found or "[::1]:50061" in found

    def answer(*infos_or_error):
        def fake_getaddrinfo(host, port, *args, **kwargs):
            if isinstance(infos_or_error[0], Exception):
                raise infos_or_error[0]
            return list(infos_or_error)
        monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)

    stream = (socket.SOCK_STREAM, 6, "")
    answer((socket.AF_INET6, *stream, ("fd00::2", 7, 0, 0)), (socket.AF_INET, *stream,
                                                               ("10.1.0.2", 7)),
           (socket.AF_INET, *stream, ("10.1.0.2", 7)))
    assert asyncio.run(SystemResolver().resolve("svc", 7)) == ["10.1.0.2:7", "[fd00::2]:7"]
    answer(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert asyncio.run(SystemResolver().resolve("svc", 7)) == []  # a Service with no ready pod
    answer(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))
    with pytest.raises(OSError):
        asyncio.run(SystemResolver().resolve("svc", 7))


# -- discovery against a registry -------------------------------------------------------------

def discovery(answers, *targets, on_removed=None):
    """A WorkerDiscovery over ``targets`` (prefill ones first) and a registry whose every worker
    answers its load poll."""
    async def fetch(address, kind):
        return LoadReport(kind)

    parsed = parse_targets([t for k, t in targets if k == "prefill"],
                           [t for k, t in targets if k == "decode"])
    registry = WorkerRegistry(WorkerDiscovery.fixed_workers(parsed), fetch, RegistryConfig())
    resolver = FakeResolver(answers)
    return WorkerDiscovery(parsed, registry, resolver, DiscoveryConfig(interval_s=0.01),
                           on_removed=on_removed), registry, resolver


def listed(registry):
    return [(w.kind, w.address) for w in registry.workers()]


def test_refresh_adds_and_retires_the_addresses_a_name_resolves_to():
    removed = []

    async def on_removed(address):
        removed.append(address)

    async def scenario():
        d, registry, resolver = discovery(
            {"p.svc": ["10.0.0.1:1", "10.0.0.2:1"], "d.svc": ["10.0.1.1:2"]},
            ("prefill", "dns:///p.svc:1"), ("decode", "dns:///d.svc:2"),
            ("decode", "127.0.0.1:9"), on_removed=on_removed)
        await d.refresh()
        assert sorted(resolver.asked) == [("d.svc", 2), ("p.svc", 1)]
        assert listed(registry) == [("prefill", "10.0.0.1:1"), ("prefill", "10.0.0.2:1"),
                                    ("decode", "10.0.1.1:2"), ("decode", "127.0.0.1:9")]
        assert not any(w.healthy for w in registry.workers())  # until they answer a poll
        await registry.poll_once()
        unhold = registry.hold("10.0.0.1:1")  # a request runs on it

        resolver.answers["p.svc"] = ["10.0.0.2:1", "10.0.0.3:1"]  # scaled: one pod replaced
        await d.refresh()
        assert listed(registry)[:2] == [("prefill", "10.0.0.2:1"), ("prefill", "10.0.0.3:1")]
        assert registry.get("10.0.0.2:1").healthy and not registry.get("10.0.0.3:1").healthy
        assert registry.get("10.0.0.1:1").holds == 1  # retired, its request goes on
        await d.refresh()
        assert removed == []
        unhold()
        await d.refresh()
        assert removed == ["10.0.0.1:1"]
        with pytest.raises(KeyError):
            registry.get("10.0.0.1:1")

        resolver.answers["d.svc"] = OSError("DNS timed out")  # keeps what it knew
        await d.refresh()
        assert ("decode", "10.0.1.1:2") in listed(registry)
        resolver.answers["d.svc"] = []  # scaled to zero: the fixed decode worker stays
        await d.refresh()
        assert [a for k, a in listed(registry) if k == "decode"] == ["127.0.0.1:9"]
        await d.refresh()
        assert removed == ["10.0.0.1:1", "10.0.1.1:2"]

    asyncio.run(scenario())


def test_an_address_two_names_resolve_to_stays_with_the_first_kind():
    async def scenario():
        d, registry, _ = discovery({"p": ["10.0.0.1:5"], "d": ["10.0.0.1:5", "10.0.0.2:5"]},
                                   ("prefill", "dns:///p:5"), ("decode", "dns:///d:5"))
        await d.refresh()
        return listed(registry)

    assert asyncio.run(scenario()) == [("prefill", "10.0.0.1:5"), ("decode", "10.0.0.2:5")]


def test_discovery_resolves_again_every_interval_until_stopped():
    async def scenario():
        d, registry, resolver = discovery({"p": ["10.0.0.1:5"]}, ("prefill", "dns:///p:5"),
                                          ("decode", "10.0.9.9:6"))
        await d.start()
        assert ("prefill", "10.0.0.1:5") in listed(registry)  # resolved before start returns
        resolver.answers["p"] = ["10.0.0.1:5", "10.0.0.2:5"]
        await wait_for(lambda: ("prefill", "10.0.0.2:5") in listed(registry))
        await d.stop()
        asked = len(resolver.asked)
        resolver.answers["p"] = []
        await asyncio.sleep(0.05)
        assert len(resolver.asked) == asked and len(listed(registry)) == 3

    asyncio.run(scenario())


def test_fixed_targets_alone_need_no_resolution():
    async def scenario():
        d, registry, resolver = discovery({}, ("prefill", "10.0.0.1:5"), ("decode", "10.0.0.2:6"))
        await d.start()
        await d.stop()
        return resolver.asked, listed(registry)

    asked, workers = asyncio.run(scenario())
    assert asked == [] and workers == [("prefill", "10.0.0.1:5"), ("decode", "10.0.0.2:6")]


# -- a router following the answers -----------------------------------------------------------

def test_a_router_takes_added_workers_once_serving_and_lets_removed_ones_finish():
    """decode A serves; the name moves to decode B (not serving yet): A's running stream ends
    normally, A gets no new request, B gets requests once its health says SERVING."""
    async def scenario():
        prefill = await start_fake("prefill")
        (server_a, a, _), (server_b, b, health_b) = [await decode_with_health()
                                                     for _ in range(2)]
        await set_serving(health_b, [], False)
        resolver = FakeResolver({"prefill.test": [prefill.address], "decode.test": [a.address]})
        router = Router(RouterConfig(
            model="tiny", prefill=("dns:///prefill.test:50061",),
            decode=("dns:///decode.test:50062",),
            registry=RegistryConfig(poll_interval_s=0.05, backoff_initial_s=0.05,
                                    backoff_max_s=0.1),
            discovery=DiscoveryConfig(interval_s=0.05)), resolver=resolver)
        address = await router.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)

                async def decode_workers():
                    reply = await stub.ListWorkers(generation_pb2.ListWorkersRequest(), timeout=5)
                    return [(w.address, w.healthy) for w in reply.workers
                            if w.address != prefill.address]

                async def run_one(i):
                    req = request_to_pb(token_ids=[1, 2 + i])
                    return [t for m in await _collect(stub, req) for t in m.token_ids]

                await wait_for(lambda: router.registry.get(a.address).healthy)
                assert await run_one(0) == list(REPLY_IDS[:16])
                a.knobs.event_delay_s = 0.05  # a long-running request on A
                slow = stub.Generate(request_to_pb(token_ids=[7], params=None), timeout=20)
                first = await slow.read()
                assert len(a.streams) == 2

                resolver.answers["decode.test"] = [b.address]
                await wait_for(lambda: [w.address for w in router.registry.workers()
                                        if w.kind == "decode"] == [b.address])
                assert await decode_workers() == [(b.address, False)]
                with pytest.raises(grpc.aio.AioRpcError) as err:  # no serving decode worker
                    await run_one(1)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert len(a.streams) == 2 and b.streams == []

                rest = []
                while (msg := await slow.read()) is not grpc.aio.EOF:
                    rest.append(msg)
                ids = [*first.token_ids, *(t for m in rest for t in m.token_ids)]
                assert ids == list(REPLY_IDS[:16]) and rest[-1].finish_reason != 0
                await wait_for(lambda: a.address not in router.clients._channels)
                with pytest.raises(KeyError):
                    router.registry.get(a.address)  # reaped once its request ended

                await set_serving(health_b, [], True)
                await wait_for(lambda: router.registry.get(b.address).healthy)
                assert await run_one(2) == list(REPLY_IDS[:16])
                assert len(b.streams) == 1 and len(a.streams) == 2
        finally:
            await router.stop(0)
            await prefill.stop()
            await server_a.stop(0)
            await server_b.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_router_resolves_names_through_the_system_resolver():
    async def scenario():
        prefill, decode = await start_fake("prefill"), await start_fake("decode")
        port = int(prefill.address.rsplit(":", 1)[1])
        router = Router(RouterConfig(model="tiny", prefill=(f"dns:///localhost:{port}",),
                                     decode=(decode.address,)))
        try:
            address = await router.start()
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                msgs = await _collect(stub, request_to_pb(token_ids=[1, 2]))
            healthy = [w.address for w in router.registry.workers() if w.healthy]
            return port, healthy, [t for m in msgs for t in m.token_ids]
        finally:
            await router.stop(0)
            await prefill.stop()
            await decode.stop()

    port, healthy, ids = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert f"127.0.0.1:{port}" in healthy and ids == list(REPLY_IDS[:16])


async def _collect(stub, req):
    return [m async for m in stub.Generate(req, timeout=10)]
