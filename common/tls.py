"""TLS material of one process (``--tls-cert``, ``--tls-key``, ``--tls-ca``) as gRPC credentials.

One identity per process: the certificate a server presents on its port is also the client
certificate its outgoing channels present, and the CA that verifies clients (mutual TLS) also
verifies the servers it connects to. See docs/security.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes: this process's certificate chain and key, and the CA it trusts.

    ``cert_chain`` and ``private_key`` come together or not at all; a client that only verifies
    the server (``flashsplit generate --router --tls-ca``) has ``root_ca`` alone.
    """

    cert_chain: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)
    root_ca: bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.cert_chain is None and self.root_ca is None:
            raise ValueError("TLS needs --tls-cert and --tls-key, or --tls-ca")

    @classmethod
    def load(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """Read the files named by the flags; None when no flag is given (plaintext)."""
        if not (cert or key or ca):
            return None
        return cls(cert_chain=_read(cert, "--tls-cert"), private_key=_read(key, "--tls-key"),
                   root_ca=_read(ca, "--tls-ca"))

    @property
    def has_identity(self) -> bool:
        return self.cert_chain is not None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        """Credentials for a listening port; with ``require_client_cert`` a client must present
        a certificate signed by ``root_ca`` (mutual TLS)."""
        if not self.has_identity:
            raise ValueError("serving TLS needs --tls-cert and --tls-key")
        if require_client_cert and self.root_ca is None:
            raise ValueError("requiring client certificates needs --tls-ca")
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.root_ca if require_client_cert else None,
            require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a channel: verify the server against ``root_ca`` (the system's roots
        when there is none) and present this process's certificate when it has one."""
        return grpc.ssl_channel_credentials(root_certificates=self.root_ca,
                                            private_key=self.private_key,
                                            certificate_chain=self.cert_chain)
