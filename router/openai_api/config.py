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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"the HTTP port must be in 0..65535, got {self.port}")
