"""TLS for a ``--metrics-port``: the process's own ``--tls-cert`` / ``--tls-key`` / ``--tls-ca``.

A service that serves its gRPC port over TLS serves its metrics over TLS too, with the same
certificate; when it also verifies its gRPC clients against ``--tls-ca`` (mutual TLS), a
scraper must present a certificate that CA signed (Prometheus: ``scheme: https`` and
``tls_config`` with ``cert_file`` / ``key_file``). docs/metrics.md.
"""

from __future__ import annotations

import ssl


def metrics_ssl_context(cert: str | None, key: str | None,
                        ca: str | None) -> ssl.SSLContext | None:
    """None without ``--tls-cert`` (plain HTTP); else a TLS 1.2+ server context. ValueError
    naming the flag for a file that cannot be read or does not hold what it should."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile=cert, keyfile=key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: cannot use them for the "
                         f"metrics port ({exc})") from None
    if ca:
        try:
            context.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--tls-ca {ca}: cannot use it for the metrics port ({exc})") \
                from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context
