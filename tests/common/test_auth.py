"""common/auth.py: secrets, constant-time checks, and the interceptor on a real server."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.auth import (AUTHORIZATION_HEADER, TOKEN_HEADER, MetadataCheck, bearer_key_matches,
                         check_secret, file_is_private, new_secret, read_secret_file,
                         secrets_match, write_secret_file)
from common.channels import ChannelSecurity, make_channel
from common.security import ServerSecurity
from tests.common.echo_server import EXPECTED, KINDS, call_each_kind, health_status, start_echo

TOKEN = "t" * 20 + "-internal"
UNAUTH = {kind: grpc.StatusCode.UNAUTHENTICATED for kind in KINDS}


def test_new_secrets_are_long_distinct_and_valid():
    a, b = new_secret(), new_secret()
    assert a != b and len(a) >= 40
    assert check_secret(a, "x") == a


def test_check_secret_refuses_short_or_unsendable_values():
    assert check_secret("  " + TOKEN + "\n", "x") == TOKEN
    with pytest.raises(ValueError, match="at least 16"):
        check_secret("short", "the token")
    with pytest.raises(ValueError, match="at least 1"):
        check_secret("   ", "the key", min_chars=0)
    with pytest.raises(ValueError, match="whitespace"):
        check_secret("abcdefgh ijklmnopq", "the token")
    with pytest.raises(ValueError, match="whitespace"):
        check_secret("abcdefgh\x00ijklmnopq", "the token")


def test_secret_files_round_trip_with_owner_only_permissions(tmp_path):
    path = tmp_path / "token"
    write_secret_file(path, TOKEN)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600" and file_is_private(str(path))
    assert read_secret_file(str(path), "the token") == TOKEN
    with pytest.raises(FileExistsError):  # never overwrites (or follows) what is there
        write_secret_file(path, TOKEN)
    path.chmod(0o644)
    assert not file_is_private(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        read_secret_file(str(tmp_path / "missing"), "the token")


def test_secrets_match_and_bearer_keys():
    assert secrets_match(TOKEN, TOKEN) and secrets_match(TOKEN.encode(), TOKEN)
    assert not secrets_match(None, TOKEN)
    assert not secrets_match("", TOKEN)
    assert not secrets_match(TOKEN[:-1], TOKEN)
    assert not secrets_match(TOKEN + "x", TOKEN)
    assert bearer_key_matches("Bearer sk-123", "sk-123")
    assert bearer_key_matches("bearer  sk-123 ", "sk-123")
    for header in (None, "", "sk-123", "Basic sk-123", "Bearer", "Bearer sk-1234", "Bearersk-123"):
        assert not bearer_key_matches(header, "sk-123"), header


def test_checks_never_echo_what_the_caller_sent():
    for check in (MetadataCheck.internal_token(TOKEN), MetadataCheck.api_key("sk-secret-key")):
        assert TOKEN not in check.refusal and "sk-secret-key" not in check.refusal
        assert TOKEN not in repr(check) and "sk-secret-key" not in repr(check)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_internal_token_guards_every_call_kind_but_health():
    async def scenario():
        echo = await start_echo(ServerSecurity(check=MetadataCheck.internal_token(TOKEN)))
        try:
            async with make_channel(echo.address) as bare:
                assert await call_each_kind(bare) == UNAUTH
                wrong = ((TOKEN_HEADER, TOKEN[:-1] + "x"),)
                assert await call_each_kind(bare, metadata=wrong) == UNAUTH
                # the API key's header does not stand in for the token
                bearer = ((AUTHORIZATION_HEADER, f"Bearer {TOKEN}"),)
                assert await call_each_kind(bare, metadata=bearer) == UNAUTH
                unknown = bare.unary_unary("/test.Echo/NoSuchMethod")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await unknown(b"x", timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert await health_status(bare) == health_pb2.HealthCheckResponse.SERVING
            assert sum(echo.invoked.values()) == 0  # no refused call reached the servicer
            async with make_channel(echo.address, ChannelSecurity.internal(TOKEN)) as ok:
                assert await call_each_kind(ok) == EXPECTED
                # the caller's own metadata still goes through beside the token
                assert await call_each_kind(ok, metadata=(("x-trace", "42"),)) == EXPECTED
            assert all(echo.invoked[k] == 2 for k in KINDS)
            assert (TOKEN_HEADER, TOKEN) in echo.metadata[-1]
            assert ("x-trace", "42") in echo.metadata[-1]
        finally:
            await echo.stop()

    run(scenario())


def test_api_key_check_takes_bearer_metadata():
    async def scenario():
        echo = await start_echo(ServerSecurity(check=MetadataCheck.api_key("sk-test-1")))
        try:
            async with make_channel(echo.address, ChannelSecurity.public("sk-test-2")) as wrong:
                assert await call_each_kind(wrong) == UNAUTH
            async with make_channel(echo.address, ChannelSecurity.public("sk-test-1")) as ok:
                assert await call_each_kind(ok) == EXPECTED
        finally:
            await echo.stop()

    run(scenario())


def test_server_security_accepts_is_the_http_check():
    open_port = ServerSecurity()
    assert open_port.accepts(None) and open_port.interceptors() == []
    keyed = ServerSecurity(check=MetadataCheck.api_key("sk-test-1"))
    assert keyed.accepts("Bearer sk-test-1")
    assert not keyed.accepts(None) and not keyed.accepts("Bearer sk-test-2")
