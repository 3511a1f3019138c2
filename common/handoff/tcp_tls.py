"""TLS for the handoff's TCP connections (the ``tcp`` transport and the per-rank streams), from
the same ``--tls-cert`` / ``--tls-key`` / ``--tls-ca`` material as the process's gRPC ports.

The listener presents the worker's certificate and, where its gRPC port verifies clients
against ``--tls-ca`` (mutual TLS), verifies the sender's in the same way; the sender verifies
the listener's certificate against ``--tls-ca`` and the host it dials (as its gRPC channel
does) and presents its own. The hello's internal token is checked after the handshake, as on
a plaintext connection.

Python's ``ssl`` loads a certificate chain only from files, and a worker holds its TLS material
as bytes (``TlsFiles``, read once at start-up, and handed to tensor-parallel followers as
bytes). So the chain and key are written, for the moment of loading, into a fresh private
directory (mode 0700, files 0600) that is removed at once.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from pathlib import Path

from common.tls import TlsFiles


def _load_identity(context: ssl.SSLContext, tls: TlsFiles) -> None:
    with tempfile.TemporaryDirectory(prefix="flashsplit-tls-") as directory:
        os.chmod(directory, 0o700)
        cert, key = Path(directory, "cert.pem"), Path(directory, "key.pem")
        for path, data in ((cert, tls.cert_chain), (key, tls.private_key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))


def server_context(tls: TlsFiles, require_client_cert: bool) -> ssl.SSLContext:
    """The listener's context: this worker's certificate; with ``require_client_cert``, a
    sender must present one that ``--tls-ca`` signed."""
    if not tls.has_identity:
        raise ValueError("a TLS handoff listener needs --tls-cert and --tls-key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_identity(context, tls)
    if require_client_cert:
        if tls.root_ca is None:
            raise ValueError("requiring client certificates needs --tls-ca")
        context.load_verify_locations(cadata=tls.root_ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: TlsFiles) -> ssl.SSLContext:
    """The sender's context: the listener's certificate verified against ``--tls-ca`` (the
    system's roots when there is none) and the host dialled; this worker's certificate
    presented when it has one."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificate and host name
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.root_ca is not None:
        context.load_verify_locations(cadata=tls.root_ca.decode("ascii"))
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if tls.has_identity:
        _load_identity(context, tls)
    return context
