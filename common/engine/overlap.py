"""Overlap scheduling of decode steps: the host schedules, fills and launches step n+1 while the
device still runs step n, and reads step n's tokens only after that.

Step n+1's input ids are step n's sampled tokens, which the host has not read yet, so they travel
on the device through the payload relay (``common/engine/relay.py``): every sampled token is
written to the relay at its request's state slot, and a launch gathers its ids from there. Tokens
sampled outside an overlapped step (prefill, a handoff's first token, a step that ran in sync)
are noted into the relay too.

The sampled tokens of a step are copied to pinned host memory without blocking, and a CUDA
event marks their arrival. Collecting a step waits on that event only, not on the device work
queued after it. The log-probabilities of the rows that asked for them are computed and copied
the same way, before that event. They need not go through the relay: no later step reads them
on the device, only the host does, from this step's own copy, so a step in which no request
asks for them leaves nothing behind that a later one could miss.

A request that finishes in step n has already been launched in step n+1. Its extra token is
dropped when step n+1 is collected. Its pages and slot are freed when step n is collected:
everything runs on one stream, so whatever next writes them is queued after the extra step.
Pages reserved for ``prompt + max_new_tokens`` cover that extra token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.engine.cuda_graph import GraphRunner, recorded_event
from common.engine.relay import PayloadRelay
from common.engine.request import Request
from common.engine.step_logprobs import StepLogprobs
from common.logprobs import TokenLogprobs

NEXT_TOKEN = "next_token"


@dataclass
class InFlight:
    """A launched decode step whose tokens the host has not read."""

    requests: list[Request]
    tokens: torch.Tensor  # [n] int64 host copy, complete once `ready` has passed
    ready: torch.cuda.Event | None
    logprobs: StepLogprobs | None = None  # host copy of the rows that asked, likewise

    def __post_init__(self) -> None:
        self.ids = {id(r) for r in self.requests}

    def token_logprobs(self) -> list[TokenLogprobs | None]:
        """Per request, its token's log-probabilities (None where it asked for none); read
        after :meth:`OverlapDecoder.collect`."""
        if self.logprobs is None:
            return [None] * len(self.requests)
        return self.logprobs.per_row(len(self.requests))


class OverlapDecoder:
    """Launches decode steps from the CUDA-graph runner with device-side input ids.

    Args:
        graphs: the engine's decode graph runner (with ``capture=False`` the same flow runs
            eagerly, which is how the CPU tests exercise it).
        num_slots: state slots of the pool (the relay has one row per slot).
    """

    def __init__(self, graphs: GraphRunner, num_slots: int) -> None:
        self.graphs = graphs
        device = graphs.kv_pool.kv.device
        self.on_gpu = device.type == "cuda"
        self.relay = PayloadRelay(num_slots, device)
        self.in_flight: InFlight | None = None
        rows = graphs.batch_sizes[-1]
        self._hosts = [torch.zeros(rows, dtype=torch.int64) for _ in range(2)]
        if self.on_gpu:
            self._hosts = [h.pin_memory() for h in self._hosts]
        self._turn = 0

    def note_tokens(self, slots: Sequence[int] | torch.Tensor, tokens: torch.Tensor) -> None:
        """The newest token of the requests in ``slots`` (sampled outside :meth:`launch`)."""
        self.relay.write(NEXT_TOKEN, slots, tokens.to(torch.int64))

    def can_launch(self, requests: Sequence[Request]) -> bool:
        """Only plain decode steps the graphs serve overlap: a prefill chunk's or a DFLASH
        step's next inputs depend on what the host reads from the step before."""
        return (self.graphs.serves(len(requests))
                and all(not r.is_prefilling and not r.speculative for r in requests))

    def launch(self, requests: list[Request],
               sample: Callable[[torch.Tensor, list[Request]], torch.Tensor]) -> InFlight | None:
        """Queue one decode step of ``requests`` (advancing their ``num_cached``); returns the
        step launched before it, for :meth:`collect`. ``sample(logits, requests)`` picks the
        tokens on the device."""
        out, batch = self.graphs.run(requests, None, device_ids=lambda ids, slots: ids.copy_(
            self.relay.read(NEXT_TOKEN, slots).view(-1, 1)))
        n = len(requests)
        tokens = sample(out.logits, requests)
        self.relay.write(NEXT_TOKEN, batch.state_slots[:n], tokens)
        logprobs = StepLogprobs.of(out.logits, tokens,
                                   [r.params.logprobs for r in requests])
        host = self._hosts[self._turn][:n]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=self.on_gpu)
        host_logprobs = logprobs.to_host() if logprobs is not None else None
        ready = recorded_event(out.logits.device)
        for r in requests:
            r.num_cached += 1
        previous, self.in_flight = self.in_flight, InFlight(list(requests), host, ready,
                                                            host_logprobs)
        return previous

    def take(self) -> InFlight | None:
        """The step in flight, if any, which is then no longer tracked (a sync step follows)."""
        previous, self.in_flight = self.in_flight, None
        return previous

    @staticmethod
    def collect(step: InFlight) -> list[int]:
        """The step's tokens (waits for them only, not for later steps)."""
        if step.ready is not None:
            step.ready.synchronize()
        return step.tokens.tolist()

    def pending_for(self, request: Request) -> int:
        """Tokens of ``request`` sampled on the device but not yet read by the host."""
        flight = self.in_flight
        return int(flight is not None and id(request) in flight.ids)
