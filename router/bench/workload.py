"""The requests a benchmark sends, and when (Poisson arrivals for a request rate)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from router.bench.config import BenchConfig

# Synthetic prompt ids: printable ASCII in the built-in byte tokenizer, and ordinary tokens in
# any real vocabulary (every BPE vocabulary has its byte-level alphabet at the low ids).
_SYNTHETIC_IDS = (33, 127)
_WORDS = ("time", "state", "model", "token", "cache", "page", "slot", "layer", "decode",
          "prefill", "stream", "batch", "graph", "kernel", "router", "worker")


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt (text or token ids), how many tokens to ask for, its seed."""

    prompt: str | tuple[int, ...]
    max_tokens: int
    seed: int


def load_prompts(path: str) -> list[str]:
    """Prompts from a file: JSON lines with a "prompt" (or "text") field, else one per line."""
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    except OSError as exc:
        raise ValueError(f"cannot read the prompts file {path}: {exc.strerror}") from None
    if not lines:
        raise ValueError(f"the prompts file {path} has no prompts")
    if not lines[0].lstrip().startswith("{"):
        return lines
    prompts = []
    for n, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}:{n}: no \"prompt\" (or \"text\") string")
        prompts.append(text)
    return prompts


def build_requests(config: BenchConfig) -> list[BenchRequest]:
    """``config.num_prompts`` requests, the same for every call with the same config."""
    rng = random.Random(config.seed)
    file_prompts = load_prompts(config.prompts_file) if config.prompts_file else None
    out = []
    for i in range(config.num_prompts):
        prompt: str | tuple[int, ...]
        if file_prompts is not None:
            prompt = file_prompts[i % len(file_prompts)]
        elif config.endpoint == "chat":
            prompt = " ".join(rng.choice(_WORDS) for _ in range(config.input_len.sample(rng)))
        else:
            prompt = tuple(rng.randrange(*_SYNTHETIC_IDS)
                           for _ in range(config.input_len.sample(rng)))
        out.append(BenchRequest(prompt, config.output_len.sample(rng), config.seed + i))
    return out


def arrival_offsets(count: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent.

    A Poisson process at ``rate`` requests per second (exponential gaps); all at 0 for no
    rate (a concurrency run) or an infinite one.
    """
    if rate is None or math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out
