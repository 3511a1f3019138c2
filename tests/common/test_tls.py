"""common/tls.py: TLS and mutual TLS on a real port, with certificates made by the test."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.auth import MetadataCheck
from common.channels import ChannelSecurity, make_channel
from common.security import ServerSecurity
from common.tls import TlsFiles
from tests.common.echo_server import EXPECTED, KINDS, call_each_kind, start_echo
from tests.tls_certs import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def server_tls(pki) -> TlsFiles:
    return TlsFiles.load(pki.server.cert, pki.server.key, pki.ca)


def client_tls(pki, identity=None, ca=None) -> TlsFiles:
    return TlsFiles.load(identity.cert if identity else None, identity.key if identity else None,
                         ca or pki.ca)


def test_load_checks_the_flags_and_files(pki, tmp_path):
    assert TlsFiles.load(None, None, None) is None
    assert TlsFiles.load(None, None, pki.ca).has_identity is False
    with pytest.raises(ValueError, match="together"):
        TlsFiles.load(pki.server.cert, None, None)
    with pytest.raises(ValueError, match="--tls-key .*cannot read"):
        TlsFiles.load(pki.server.cert, str(tmp_path / "nope.key"), None)
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="--tls-ca .*not a PEM"):
        TlsFiles.load(None, None, str(tmp_path / "junk.pem"))
    files = TlsFiles.load(pki.server.cert, pki.server.key, None)
    assert "PRIVATE" not in repr(files)  # the key never reaches a log line
    with pytest.raises(ValueError, match="needs --tls-ca"):
        files.server_credentials(require_client_cert=True)
    with pytest.raises(ValueError, match="needs --tls-cert"):
        TlsFiles.load(None, None, pki.ca).server_credentials(require_client_cert=False)


def test_server_security_refuses_impossible_combinations(pki):
    with pytest.raises(ValueError, match="--tls-cert"):
        ServerSecurity(tls=TlsFiles.load(None, None, pki.ca))
    with pytest.raises(ValueError, match="--tls-ca"):
        ServerSecurity(tls=TlsFiles.load(pki.server.cert, pki.server.key, None),
                       require_client_cert=True)


async def outcomes(address: str, security: ChannelSecurity) -> dict[str, object]:
    async with make_channel(address, security) as channel:
        return await call_each_kind(channel, timeout_s=5)


def refused(result: dict[str, object]) -> bool:
    """Every kind failed without reaching the servicer (a failed handshake is UNAVAILABLE)."""
    return all(isinstance(v, grpc.StatusCode) for v in result.values())


def test_tls_server_talks_to_clients_that_verify_it(pki):
    async def scenario():
        echo = await start_echo(ServerSecurity(tls=server_tls(pki)))
        try:
            assert await outcomes(echo.address, ChannelSecurity(tls=client_tls(pki))) == EXPECTED
            # a plaintext client, and one trusting another CA, get nothing through
            assert refused(await outcomes(echo.address, ChannelSecurity()))
            other = TlsFiles.load(None, None, pki.stranger_ca)
            assert refused(await outcomes(echo.address, ChannelSecurity(tls=other)))
            assert all(echo.invoked[k] == 1 for k in KINDS)
        finally:
            await echo.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki):
    async def scenario():
        echo = await start_echo(ServerSecurity(tls=server_tls(pki), require_client_cert=True))
        try:
            assert refused(await outcomes(echo.address, ChannelSecurity(tls=client_tls(pki))))
            stranger = client_tls(pki, pki.stranger)
            assert refused(await outcomes(echo.address, ChannelSecurity(tls=stranger)))
            assert sum(echo.invoked.values()) == 0
            good = ChannelSecurity(tls=client_tls(pki, pki.client))
            assert await outcomes(echo.address, good) == EXPECTED
        finally:
            await echo.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_tls_and_token_together(pki):
    token = "k" * 32

    async def scenario():
        echo = await start_echo(ServerSecurity(tls=server_tls(pki), require_client_cert=True,
                                               check=MetadataCheck.internal_token(token)))
        try:
            certified = client_tls(pki, pki.client)
            no_token = await outcomes(echo.address, ChannelSecurity(tls=certified))
            assert no_token == {k: grpc.StatusCode.UNAUTHENTICATED for k in KINDS}
            both = ChannelSecurity.internal(token, certified)
            assert await outcomes(echo.address, both) == EXPECTED
        finally:
            await echo.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
