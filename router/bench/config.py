"""What one ``flashsplit bench`` run measures: the server, the workload, the load points."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from common.tls import TlsFiles

BACKENDS = ("grpc", "openai")
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class LengthDist:
    """A length in tokens: fixed (low == high) or uniform over [low, high]."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"a length range needs 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``"128"`` (fixed) or ``"64:256"`` (uniform)."""
        try:
            low, _, high = text.partition(":")
            return cls(int(low), int(high or low))
        except ValueError as exc:
            raise ValueError(f"a length is N or LOW:HIGH, got {text!r} ({exc})") from None

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class Load:
    """One load point: a fixed number of requests in flight, or a Poisson arrival rate."""

    concurrency: int | None = None
    request_rate: float | None = None  # requests per second; inf sends them all at once

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a load point has a concurrency or a request rate, not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {self.request_rate}")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        rate = self.request_rate
        return "rate inf" if math.isinf(rate) else f"rate {rate:g}/s"

    def as_dict(self) -> dict:
        if self.concurrency is not None:
            return {"concurrency": self.concurrency}
        return {"request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate}


def parse_loads(concurrency: str | None, request_rate: str | None) -> tuple[Load, ...]:
    """``--concurrency 1,4,16`` or ``--request-rate 2,8,inf`` as load points."""
    if concurrency and request_rate:
        raise ValueError("give --concurrency or --request-rate, not both")
    try:
        if request_rate:
            return tuple(Load(request_rate=float(r)) for r in request_rate.split(",") if r)
        return tuple(Load(concurrency=int(c)) for c in (concurrency or "1").split(",") if c)
    except ValueError as exc:
        raise ValueError(f"bad load list: {exc}") from None


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. Each load point sends the same ``num_prompts`` requests (drawn once
    from ``seed``), so points differ only in load.

    backend "grpc": ``url`` is the router's host:port. backend "openai": ``url`` is the server's
    base URL (``http://host:port``; ``/v1`` is added when missing) and ``endpoint`` picks
    ``/v1/completions`` or ``/v1/chat/completions``; ``model`` defaults to the first model the
    server lists. Prompts are random token ids of ``input_len`` tokens (chat: as many random
    words, so about that many tokens), or lines of ``prompts_file``.
    """

    backend: str
    url: str
    loads: tuple[Load, ...]
    num_prompts: int = 32
    input_len: LengthDist = LengthDist(32, 32)
    output_len: LengthDist = LengthDist(32, 32)
    prompts_file: str | None = None
    endpoint: str = "completions"
    model: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # fixed output lengths: the requested number of tokens, whatever the model says
    ignore_eos: bool = True
    speculative: bool | None = None
    max_concurrency: int | None = None
    warmup: int = 1
    timeout_s: float = 600.0
    json_path: str | None = None
    plot_path: str | None = None
    progress: bool = True
    api_key: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.backend == "grpc" and self.endpoint != "completions":
            raise ValueError("--endpoint chat needs --backend openai (the gRPC API takes "
                             "prompts, not messages)")
        if not self.loads:
            raise ValueError("no load point given")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ending in /v1."""
        url = self.url.rstrip("/")
        if "://" not in url:
            url = "http://" + url
        return url if url.endswith("/v1") else url + "/v1"

    def describe(self) -> dict:
        """The settings, as written to the JSON report (no secrets)."""
        return {"backend": self.backend, "url": self.url, "endpoint": self.endpoint,
                "model": self.model, "num_prompts": self.num_prompts,
                "input_len": str(self.input_len), "output_len": str(self.output_len),
                "prompts_file": self.prompts_file, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "ignore_eos": self.ignore_eos, "speculative": self.speculative,
                "max_concurrency": self.max_concurrency, "warmup": self.warmup,
                "loads": [load.as_dict() for load in self.loads]}
