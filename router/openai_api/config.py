"""The HTTP API's settings (importing this does not import the HTTP stack)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HttpConfig:
    """Where the HTTP API listens and what it answers to.

    served_model_name is the name clients put in ``model`` (default: the router's ``--model``,
    and the last part of a checkpoint path is accepted too). The API key, if any, is the
    router's public one (``Authorization: Bearer <key>`` on every route but ``/health``).
    """

    host: str = "127.0.0.1"
    port: int = 0
    served_model_name: str | None = None
    # HTTPS: the router's own --tls-cert / --tls-key (paths, as uvicorn takes them); with
    # require_client_cert, clients must present a certificate --tls-ca signed, as on the
    # router's gRPC port
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    require_client_cert: bool = False

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"the HTTP port must be in 0..65535, got {self.port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.require_client_cert and not (self.tls_cert and self.tls_ca):
            raise ValueError("requiring client certificates needs --tls-cert and --tls-ca")
