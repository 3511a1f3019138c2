"""flashsplit-router's security flags, and its public port behind an API key (fake workers)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.auth import MetadataCheck, TOKEN_HEADER
from common.channels import ChannelSecurity, make_channel
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc
from common.security import API_KEY_ENV, TOKEN_ENV, ServerSecurity
from router.__main__ import build_parser, config_from_args
from router.remote import generate, request_to_pb
from router.server import Router, RouterConfig
from tests.common.echo_server import health_status
from tests.router.fakes import REPLY_IDS, start_fake

TOKEN = "r" * 32
WORKERS = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]


def config(*argv: str, environ=None) -> RouterConfig:
    return config_from_args(build_parser().parse_args([*WORKERS, *argv]),
                            {TOKEN_ENV: TOKEN} if environ is None else environ)


def test_flags_become_the_router_config():
    c = config("--api-key", "sk-1")
    assert c.internal.metadata == ((TOKEN_HEADER, TOKEN),)
    assert c.public.accepts("Bearer sk-1") and not c.public.accepts(None)
    assert c.public.tls is None
    open_port = config(environ={TOKEN_ENV: TOKEN})
    assert open_port.public.check is None
    from_env = config(environ={TOKEN_ENV: TOKEN, API_KEY_ENV: "sk-env"})
    assert from_env.public.accepts("Bearer sk-env")
    with pytest.raises(ValueError, match="no internal token"):
        config(environ={})
    assert config("--insecure-no-auth", environ={}).internal.metadata == ()


def test_the_public_port_asks_for_the_key_but_health_does_not():
    async def scenario():
        prefill, decode = await start_fake("prefill"), await start_fake("decode")
        router = Router(RouterConfig(
            model="tiny", prefill=(prefill.address,), decode=(decode.address,),
            public=ServerSecurity(check=MetadataCheck.api_key("sk-test"))))
        address = await router.start()
        try:
            request = request_to_pb(text="Hi")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(address, request, timeout_s=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with make_channel(address) as bare:
                stub = generation_pb2_grpc.GenerationStub(bare)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ListWorkers(generation_pb2.ListWorkersRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert await health_status(bare) == health_pb2.HealthCheckResponse.SERVING
            assert prefill.servicer.calls == []  # refused before any worker was involved
            done = await generate(address, request, timeout_s=10,
                                  security=ChannelSecurity.public("sk-test"))
            assert tuple(done.token_ids) == REPLY_IDS[:16]  # the default max_new_tokens
        finally:
            await router.stop(0)
            await prefill.stop()
            await decode.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
