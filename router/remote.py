"""A client of the public Generation service (used by ``flashsplit generate --router``).

Streams a completion and collects it into a ``Completion``; ``on_text`` sees each text delta as
it arrives, so a terminal can print the output while it is generated, and ``on_tokens`` each
message's token ids (a token whose text is not complete yet has ids and no text).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.channels import ChannelSecurity, make_channel
from common.convert import finish_reason_from_pb, logprobs_from_pb, sampling_to_pb
from common.logprobs import TokenLogprobs
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc
from common.sampling import SamplingParams


@dataclass
class Completion:
    """A whole completion as the client received it (timings as measured by the router)."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    # one per token when the request asks for them (SamplingParams.logprobs)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    time_to_first_token_s: float = 0.0
    inter_token_latencies_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    # the prefill worker's own account (PrefillTimings): queue_s runs from the call's arrival,
    # so it holds the handoff's opening (decode's reservation) besides the engine's queue
    prefill_queue_s: float = 0.0
    prefill_s: float = 0.0
    handoff_s: float = 0.0
    seconds: float = 0.0  # wall time of the call at the client


def request_to_pb(*, text: str | None = None, token_ids: Sequence[int] | None = None,
                  params: SamplingParams | None = None, request_id: str = "",
                  stop: Sequence[str] = ()) -> generation_pb2.GenerateRequest:
    """A GenerateRequest; ``stop`` strings end the completion before their first occurrence."""
    req = generation_pb2.GenerateRequest(request_id=request_id, stop=list(stop))
    if (text is None) == (token_ids is None):
        raise ValueError("give exactly one of text and token_ids")
    if text is not None:
        req.text = text
    else:
        req.token_ids.ids.extend(token_ids)
    if params is not None:
        req.sampling.CopyFrom(sampling_to_pb(params))
    return req


async def generate(address: str, request: generation_pb2.GenerateRequest, *,
                   timeout_s: float = 600.0,
                   on_text: Callable[[str], None] | None = None,
                   on_tokens: Callable[[Sequence[int]], None] | None = None,
                   security: ChannelSecurity = ChannelSecurity(),
                   channel=None) -> Completion:
    """Run one streaming Generate call (with ``security``'s API key and TLS, when the router's
    port asks for them); raises grpc.aio.AioRpcError when the router fails it. ``channel``: an
    open channel to ``address`` to call on (a client making many calls keeps one), else one is
    opened for this call."""
    out = Completion()
    start = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        if channel is None:
            channel = await stack.enter_async_context(make_channel(address, security))
        stub = generation_pb2_grpc.GenerationStub(channel)
        async for msg in stub.Generate(request, timeout=timeout_s):
            out.request_id = msg.request_id
            out.text += msg.text
            out.token_ids.extend(msg.token_ids)
            out.accept_lengths.extend(msg.accept_lengths)
            out.logprobs.extend(logprobs_from_pb(lp) for lp in msg.logprobs)
            if msg.token_ids and on_tokens is not None:
                on_tokens(msg.token_ids)
            if msg.text and on_text is not None:
                on_text(msg.text)
            reason = finish_reason_from_pb(msg.finish_reason)
            if reason:
                out.finish_reason = reason
                out.prompt_tokens = msg.usage.prompt_tokens
                out.time_to_first_token_s = msg.timings.time_to_first_token_s
                out.inter_token_latencies_s = list(msg.timings.inter_token_latencies_s)
                out.total_s = msg.timings.total_s
                out.prefill_queue_s = msg.timings.prefill_queue_s
                out.prefill_s = msg.timings.prefill_s
                out.handoff_s = msg.timings.handoff_s
    out.seconds = time.perf_counter() - start
    return out
