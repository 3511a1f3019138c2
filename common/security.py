"""A process's security settings from its flags and environment, and what its ports demand.

The three service commands share ``--internal-token-file``, ``--insecure-no-auth`` and the
``--tls-*`` flags (``add_security_args``); the router adds its public API key
(``add_api_key_args``); ``flashsplit generate --router`` has the client's side
(``add_client_args``). Settings become frozen ``Security`` / ``ServerSecurity`` values passed
explicitly to servers and channels. See docs/security.md.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from common.auth import (AuthInterceptor, MetadataCheck, check_secret, file_is_private,
                         read_secret_file)
from common.channels import ChannelSecurity
from common.tls import TlsFiles

log = logging.getLogger(__name__)

TOKEN_FILE_ENV = "FLASHSPLIT_INTERNAL_TOKEN_FILE"
# The token itself: how `flashsplit up` hands its generated secret to its children (a process's
# environment is readable by its owner only, unlike its command line).
TOKEN_ENV = "FLASHSPLIT_INTERNAL_TOKEN"
API_KEY_ENV = "FLASHSPLIT_API_KEY"
# The API key is the operator's choice, as with vLLM's --api-key (its documented example is 12
# characters); only the internal token, which nobody types, has a minimum length.
API_KEY_MIN_CHARS = 1

NO_TOKEN = (f"no internal token: give --internal-token-file PATH (or set {TOKEN_FILE_ENV}); "
            "every process of a cluster needs the same one. Create one with\n"
            "  (umask 077; python -c 'import secrets; print(secrets.token_urlsafe(32))' "
            "> token)\n"
            "or pass --insecure-no-auth to serve the internal RPCs to anyone who can reach "
            "the port")


@dataclass(frozen=True)
class ServerSecurity:
    """What a listening port demands: TLS (None = plaintext), client certificates (mutual
    TLS), and a metadata secret on every call but health checks (None = none)."""

    tls: TlsFiles | None = None
    require_client_cert: bool = False
    check: MetadataCheck | None = None

    def __post_init__(self) -> None:
        if self.tls is not None and not self.tls.has_identity:
            raise ValueError("serving TLS needs --tls-cert and --tls-key")
        if self.require_client_cert and (self.tls is None or self.tls.root_ca is None):
            raise ValueError("requiring client certificates needs --tls-ca")

    def accepts(self, value: str | None) -> bool:
        """Whether a call carrying ``value`` in ``check.header`` is let in (always, when the
        port has no check). An HTTP front end on the router passes its ``Authorization``
        header here, so both protocols accept exactly the same keys."""
        return self.check is None or self.check.accept(value)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [AuthInterceptor(self.check)] if self.check is not None else []

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        return self.tls.server_credentials(self.require_client_cert)


@dataclass(frozen=True)
class Security:
    """One process's internal token (None: internal RPCs unauthenticated) and TLS files."""

    internal_token: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None

    def internal_server(self) -> ServerSecurity:
        """A worker's port: the token on every call; TLS with a certificate, and client
        certificates required when a CA is given."""
        if self.tls is not None and not self.tls.has_identity:
            raise ValueError("a worker serving TLS needs --tls-cert and --tls-key "
                             "(--tls-ca alone only verifies the servers it connects to)")
        return ServerSecurity(
            tls=self.tls, require_client_cert=self.tls is not None and self.tls.root_ca is not None,
            check=None if self.internal_token is None
            else MetadataCheck.internal_token(self.internal_token))

    def internal_channel(self) -> ChannelSecurity:
        """A channel to a worker: the token on every call, TLS when any --tls-* flag is set."""
        return ChannelSecurity.internal(self.internal_token, self.tls)

    def public_server(self, api_key: str | None, *,
                      client_cert: bool = True) -> ServerSecurity:
        """The router's public port: the API key when given; TLS when it has a certificate,
        asking clients for one when a CA is given unless ``client_cert`` is False."""
        tls = self.tls if self.tls is not None and self.tls.has_identity else None
        return ServerSecurity(
            tls=tls, require_client_cert=client_cert and tls is not None
            and tls.root_ca is not None,
            check=None if api_key is None else MetadataCheck.api_key(api_key))


def add_security_args(p: argparse.ArgumentParser) -> None:
    """Flags every service takes: the internal token and TLS."""
    g = p.add_argument_group("security (docs/security.md)")
    g.add_argument("--internal-token-file", metavar="PATH", default=None,
                   help=f"file holding the secret every internal RPC carries (default: "
                        f"${TOKEN_FILE_ENV}); required unless --insecure-no-auth")
    g.add_argument("--insecure-no-auth", action="store_true",
                   help="serve and call internal RPCs without a token (trusted networks only)")
    add_tls_args(g)


def add_tls_args(p) -> None:
    p.add_argument("--tls-cert", metavar="PEM", default=None,
                   help="certificate chain: this process serves TLS and presents it to the "
                        "servers it connects to")
    p.add_argument("--tls-key", metavar="PEM", default=None, help="the certificate's key")
    p.add_argument("--tls-ca", metavar="PEM", default=None,
                   help="CA that verifies the servers this process connects to; on a port this "
                        "process serves, clients must present a certificate it signed (mTLS)")


def internal_token_from(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The token: --internal-token-file, else $FLASHSPLIT_INTERNAL_TOKEN_FILE, else
    $FLASHSPLIT_INTERNAL_TOKEN; ValueError when there is none and --insecure-no-auth is not
    given, or when both are."""
    path = args.internal_token_file or environ.get(TOKEN_FILE_ENV) or None
    if path is not None:
        token = read_secret_file(path, "the internal token")
        if not file_is_private(path):
            log.warning("internal token file %s is readable by other users; chmod 600 it", path)
    elif environ.get(TOKEN_ENV):
        token = check_secret(environ[TOKEN_ENV], f"${TOKEN_ENV}")
    else:
        token = None
    if token is not None and args.insecure_no_auth:
        raise ValueError("--insecure-no-auth contradicts the internal token that is configured")
    if token is None and not args.insecure_no_auth:
        raise ValueError(NO_TOKEN)
    if token is None:
        log.warning("--insecure-no-auth: internal RPCs are open to anyone who can reach this "
                    "port (forged handoffs, reading any request's tokens, aborts)")
    return token


def security_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Security:
    """The settings ``add_security_args`` declares; ValueError on a caller's mistake."""
    return Security(internal_token=internal_token_from(args, environ),
                    tls=TlsFiles.load(args.tls_cert, args.tls_key, args.tls_ca))


def add_api_key_args(p: argparse.ArgumentParser) -> None:
    """The router's public-port flags."""
    g = p.add_argument_group("public port")
    g.add_argument("--api-key", default=None,
                   help=f"require 'authorization: Bearer KEY' on every public call (default: "
                        f"${API_KEY_ENV}; a flag's value is visible in ps, prefer the file or "
                        f"the variable)")
    g.add_argument("--api-key-file", metavar="PATH", default=None,
                   help="file holding the API key")
    g.add_argument("--public-no-client-cert", action="store_true",
                   help="with --tls-ca, do not ask public clients for a certificate (the "
                        "workers are still verified with it)")


def api_key_from(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--api-key, else --api-key-file, else $FLASHSPLIT_API_KEY; None: the port is open."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key is not None:
        return check_secret(args.api_key, "--api-key", API_KEY_MIN_CHARS)
    if args.api_key_file is not None:
        return read_secret_file(args.api_key_file, "the API key", API_KEY_MIN_CHARS)
    if environ.get(API_KEY_ENV):
        return check_secret(environ[API_KEY_ENV], f"${API_KEY_ENV}", API_KEY_MIN_CHARS)
    return None


def add_client_args(p: argparse.ArgumentParser) -> None:
    """A client of the public port (``flashsplit generate --router``)."""
    p.add_argument("--api-key", default=None,
                   help=f"sent as 'authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    add_tls_args(p)


def client_channel_from(args: argparse.Namespace, environ: Mapping[str, str]) -> ChannelSecurity:
    """The public client's channel settings from ``add_client_args``' flags."""
    key = args.api_key if args.api_key is not None else environ.get(API_KEY_ENV) or None
    return ChannelSecurity.public(key, TlsFiles.load(args.tls_cert, args.tls_key, args.tls_ca))
