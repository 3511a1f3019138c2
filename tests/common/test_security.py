"""common/security.py: flags and environment -> what each port demands and each channel sends."""

from __future__ import annotations

import argparse
import logging

import pytest

from common.auth import AUTHORIZATION_HEADER, TOKEN_HEADER, write_secret_file
from common.security import (API_KEY_ENV, TOKEN_ENV, TOKEN_FILE_ENV, Security,
                             add_api_key_args, add_client_args, add_security_args, api_key_from,
                             client_channel_from, security_from_args)
from tests.tls_certs import make_pki

TOKEN = "s" * 24
OTHER = "o" * 24


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_security_args(p)
    add_api_key_args(p)
    return p.parse_args(list(argv))


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    write_secret_file(path, TOKEN)
    return str(path)


def test_no_token_refuses_with_the_way_out():
    way_out = "(?s)--internal-token-file.*umask 077.*--insecure-no-auth"
    with pytest.raises(ValueError, match=way_out):
        security_from_args(parse(), {})


def test_insecure_no_auth_serves_open_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        security = security_from_args(parse("--insecure-no-auth"), {})
    assert security.internal_token is None
    assert security.internal_server().check is None
    assert security.internal_channel().metadata == ()
    assert "open to anyone" in caplog.text


def test_token_sources_in_order(token_file, tmp_path):
    other_file = tmp_path / "other"
    write_secret_file(other_file, OTHER)
    env = {TOKEN_FILE_ENV: str(other_file), TOKEN_ENV: "e" * 24}
    assert security_from_args(parse("--internal-token-file", token_file), env) \
        .internal_token == TOKEN
    assert security_from_args(parse(), env).internal_token == OTHER
    assert security_from_args(parse(), {TOKEN_ENV: "e" * 24}).internal_token == "e" * 24
    with pytest.raises(ValueError, match="contradicts"):
        security_from_args(parse("--insecure-no-auth"), {TOKEN_ENV: "e" * 24})
    with pytest.raises(ValueError, match="at least 16"):
        security_from_args(parse(), {TOKEN_ENV: "short"})


def test_a_token_file_others_can_read_is_warned_about(token_file, caplog):
    import os
    os.chmod(token_file, 0o644)
    with caplog.at_level(logging.WARNING):
        security_from_args(parse("--internal-token-file", token_file), {})
    assert "chmod 600" in caplog.text


def test_the_token_reaches_the_port_and_the_channel_not_the_repr(token_file):
    security = security_from_args(parse("--internal-token-file", token_file), {})
    assert security.internal_server().accepts(TOKEN)
    assert not security.internal_server().accepts(OTHER)
    assert security.internal_channel().metadata == ((TOKEN_HEADER, TOKEN),)
    assert TOKEN not in repr(security) and TOKEN not in repr(security.internal_channel())
    assert len(security.internal_server().interceptors()) == 1


def test_tls_flags_decide_mtls_per_port(tmp_path):
    pki = make_pki(tmp_path / "pki")
    env = {TOKEN_ENV: TOKEN}
    tls_only = security_from_args(parse("--tls-cert", pki.server.cert, "--tls-key",
                                        pki.server.key), env)
    assert not tls_only.internal_server().require_client_cert
    assert tls_only.internal_server().credentials() is not None
    mtls = security_from_args(parse("--tls-cert", pki.server.cert, "--tls-key", pki.server.key,
                                    "--tls-ca", pki.ca), env)
    assert mtls.internal_server().require_client_cert
    assert mtls.internal_channel().tls is mtls.tls  # the same identity outward
    assert mtls.public_server(None).require_client_cert
    assert not mtls.public_server(None, client_cert=False).require_client_cert
    ca_only = security_from_args(parse("--tls-ca", pki.ca), env)
    with pytest.raises(ValueError, match="worker serving TLS"):
        ca_only.internal_server()
    # a router with only a CA: plaintext public port, TLS to the workers
    assert ca_only.public_server(None).tls is None and ca_only.internal_channel().tls
    assert Security().public_server(None).credentials() is None


def test_api_key_sources(tmp_path):
    key_file = tmp_path / "key"
    write_secret_file(key_file, "sk-file")
    env = {API_KEY_ENV: "sk-env"}
    assert api_key_from(parse("--api-key", "sk-flag"), env) == "sk-flag"
    assert api_key_from(parse("--api-key-file", str(key_file)), env) == "sk-file"
    assert api_key_from(parse(), env) == "sk-env"
    assert api_key_from(parse(), {}) is None
    with pytest.raises(ValueError, match="not both"):
        api_key_from(parse("--api-key", "a", "--api-key-file", str(key_file)), {})
    with pytest.raises(ValueError, match="whitespace"):
        api_key_from(parse("--api-key", "two words"), {})
    public = Security().public_server("sk-flag")
    assert public.accepts("Bearer sk-flag") and not public.accepts("Bearer sk-env")


def test_client_side_flags():
    p = argparse.ArgumentParser()
    add_client_args(p)
    channel = client_channel_from(p.parse_args([]), {API_KEY_ENV: "sk-env"})
    assert channel.metadata == ((AUTHORIZATION_HEADER, "Bearer sk-env"),) and channel.tls is None
    channel = client_channel_from(p.parse_args(["--api-key", "sk-flag"]), {API_KEY_ENV: "x"})
    assert channel.metadata == ((AUTHORIZATION_HEADER, "Bearer sk-flag"),)
    assert client_channel_from(p.parse_args([]), {}).metadata == ()
