"""Fake prefill and decode workers that speak the real wire protocol, with failure knobs.

The fake prefill "computes" the first token of a canned reply and pushes a header-only handoff
to the decode address it is given, over the real ``Decode.Handoff`` RPC; the fake decode streams
the rest of the reply once that handoff arrived. So the router under test sees the same ordering
and the same failure shapes as with real workers, without a model.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

import grpc

from common.grpc_util import SERVER_OPTIONS
from common.pb.flashsplit.v1 import (decode_pb2, decode_pb2_grpc, prefill_pb2,
                                     prefill_pb2_grpc, types_pb2)

# Byte-tokenizer ids of a reply with multi-byte characters, so text deltas must not split them.
REPLY_TEXT = "Héllo, wörld ✓ — fake decode!"
REPLY_IDS = tuple(REPLY_TEXT.encode("utf-8"))
FINGERPRINT = "fake-model-fingerprint"


def fake_logprobs(position: int, token: int, num_top: int) -> types_pb2.TokenLogprobs:
    """Made-up log-probabilities of the reply's ``position``-th token: its own is the most
    likely, then ids counting down from it; the first position's are a very unlikely token."""
    chosen = -1e6 if position == 0 else -0.25 * position
    top = [token] + [(token - i) % 256 for i in range(1, num_top)]
    return types_pb2.TokenLogprobs(logprob=chosen, top_token_ids=top[:num_top],
                                   top_logprobs=[chosen - i for i in range(num_top)])


@dataclass
class PrefillKnobs:
    fail_with: grpc.StatusCode | None = None   # answer every Prefill with this status
    delay_s: float = 0.0                        # before the handoff is pushed
    early_first_token: bool = True              # send the first token before the handoff
    early_token: int | None = None              # that token, when not the one decode gets
    handoff_delay_s: float = 0.0                # between the early token and the handoff
    fail_after_first_token: int = 0             # calls that end UNAVAILABLE after it
    queue_len: int = 0


@dataclass
class DecodeKnobs:
    refuse_with: grpc.StatusCode | None = None  # refuse every handoff with this status
    break_after: int | None = None              # abort the stream (UNAVAILABLE) after k tokens
    tokens_per_event: int = 1
    event_delay_s: float = 0.0
    free_slots: int = 8
    free_pages: int = 64
    send_logprobs: bool = True                  # False: leave out the ones a request asks for
    without_draft_context: bool = False         # decline every handoff's draft context


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, address: str = "") -> None:
        self.address = address
        self.knobs = PrefillKnobs()
        self.calls: list[prefill_pb2.PrefillRequest] = []
        self.aborts: list[int] = []

    async def Prefill(self, request, context):
        await context.write(prefill_pb2.PrefillUpdate(done=await self._run(request, context)))

    async def _run(self, request, context):
        self.calls.append(request)
        if self.knobs.fail_with is not None:
            await context.abort(self.knobs.fail_with, f"fake prefill {self.address} failing")
        await asyncio.sleep(self.knobs.delay_s)
        first = REPLY_IDS[0]
        timings = prefill_pb2.PrefillTimings(queue_s=0.001, prefill_s=0.002, handoff_s=0.003)
        if request.sampling.max_new_tokens == 1:
            response = prefill_pb2.PrefillResponse(
                handoff_id=request.handoff_id, first_token=first,
                prompt_len=len(request.prompt_token_ids), timings=timings,
                finish_reason=types_pb2.FINISH_REASON_LENGTH)
            if request.sampling.HasField("logprobs"):
                response.first_token_logprobs.CopyFrom(
                    fake_logprobs(0, first, request.sampling.logprobs))
            return response
        header = decode_pb2.HandoffHeader(
            handoff_id=request.handoff_id, model_fingerprint=FINGERPRINT,
            prompt_len=len(request.prompt_token_ids),
            prompt_token_ids=request.prompt_token_ids, sampling=request.sampling,
            request_id=request.request_id)
        async with grpc.aio.insecure_channel(request.decode_address) as ch:
            # as the real worker does: the header (decode reserves or refuses), the prompt's
            # computation (the delay), the first token to the router, then the rest
            call = decode_pb2_grpc.DecodeStub(ch).Handoff(timeout=5)
            try:
                await call.write(decode_pb2.HandoffMessage(header=header))
                await self._reply(call, "accepted")
                await self._early_first_token(request, first, context)
                await call.write(decode_pb2.HandoffMessage(
                    trailer=decode_pb2.HandoffTrailer(first_token=first)))
                await call.done_writing()
                await self._reply(call, "ack")
            except grpc.aio.AioRpcError as exc:
                # The decode worker's refusal is passed through with its own status.
                await context.abort(exc.code(), f"handoff to {request.decode_address}: "
                                                f"{exc.details()}")
        return prefill_pb2.PrefillResponse(handoff_id=request.handoff_id, first_token=first,
                                           prompt_len=len(request.prompt_token_ids),
                                           timings=timings)

    @staticmethod
    async def _reply(call, expected: str) -> None:
        reply = await call.read()  # raises AioRpcError when decode ended the call with a status
        if reply is grpc.aio.EOF or reply.WhichOneof("reply") != expected:
            raise AssertionError(f"fake prefill expected {expected!r} from decode, got {reply!r}")

    async def _early_first_token(self, request, first: int, context) -> None:
        if not self.knobs.early_first_token:
            return
        early = prefill_pb2.FirstToken(token_id=first if self.knobs.early_token is None
                                       else self.knobs.early_token)
        if request.sampling.HasField("logprobs"):
            early.logprobs.CopyFrom(fake_logprobs(0, first, request.sampling.logprobs))
        await context.write(prefill_pb2.PrefillUpdate(first_token=early))
        if self.knobs.fail_after_first_token:
            self.knobs.fail_after_first_token -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"fake prefill {self.address} died after its first token")
        await asyncio.sleep(self.knobs.handoff_delay_s)

    async def Abort(self, request, context):
        self.aborts.append(request.handoff_id)
        return types_pb2.AbortResponse(found=False)

    async def GetLoad(self, request, context):
        return types_pb2.LoadReport(kind=types_pb2.WORKER_KIND_PREFILL, address=self.address,
                                    model_fingerprint=FINGERPRINT,
                                    queue_len=self.knobs.queue_len)


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, address: str = "") -> None:
        self.address = address
        self.knobs = DecodeKnobs()
        self.handoffs: dict[int, decode_pb2.HandoffHeader] = {}
        self.first_tokens: dict[int, int] = {}
        self.chunk_fields: dict[int, set[str]] = defaultdict(set)  # fields that came as chunks
        self._arrived: dict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.streams: list[int] = []
        self.cancelled_streams: list[int] = []
        self.aborts: list[int] = []

    async def Handoff(self, request_iterator, context):
        header = None
        async for msg in request_iterator:
            if msg.HasField("trailer"):
                self.first_tokens[header.handoff_id] = msg.trailer.first_token
            if msg.HasField("chunk"):
                self.chunk_fields[header.handoff_id].add(msg.chunk.field)
            if msg.HasField("header"):
                header = msg.header
                if self.knobs.refuse_with is not None:
                    await context.abort(self.knobs.refuse_with, "fake decode: no room")
                yield decode_pb2.HandoffReply(accepted=decode_pb2.HandoffAccepted(
                    handoff_id=header.handoff_id,
                    without_draft_context=self.knobs.without_draft_context))
        if header is None or header.handoff_id not in self.first_tokens:
            return  # the sender went away before its trailer: nothing arrived
        self.handoffs[header.handoff_id] = header
        self._arrived[header.handoff_id].set()
        yield decode_pb2.HandoffReply(ack=decode_pb2.HandoffAck(handoff_id=header.handoff_id))

    async def Stream(self, request, context):
        hid = request.handoff_id
        self.streams.append(hid)
        try:
            await self._arrived[hid].wait()
            header = self.handoffs[hid]
            limit = header.sampling.max_new_tokens
            out = [self.first_tokens[hid], *REPLY_IDS[1:]][:limit]
            finish = (types_pb2.FINISH_REASON_LENGTH if len(out) == limit
                      else types_pb2.FINISH_REASON_STOP)
            k, sent = self.knobs.tokens_per_event, 0
            while sent < len(out):
                if self.knobs.break_after is not None and sent >= self.knobs.break_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode crashed")
                if sent and self.knobs.event_delay_s:
                    await asyncio.sleep(self.knobs.event_delay_s)
                step = out[sent:sent + (1 if sent == 0 else k)]
                logprobs = [fake_logprobs(sent + i, t, header.sampling.logprobs)
                            for i, t in enumerate(step)] \
                    if header.sampling.HasField("logprobs") and self.knobs.send_logprobs else []
                sent += len(step)
                yield decode_pb2.TokenEvent(
                    # the first token comes from the prefill: no step accepted it
                    token_ids=step, accept_lengths=[len(step)] if sent > len(step) else [],
                    finish_reason=finish if sent == len(out) else 0, logprobs=logprobs)
        except asyncio.CancelledError:
            self.cancelled_streams.append(hid)
            raise

    async def Abort(self, request, context):
        self.aborts.append(request.handoff_id)
        return types_pb2.AbortResponse(found=request.handoff_id in self.handoffs)

    async def GetLoad(self, request, context):
        return types_pb2.LoadReport(kind=types_pb2.WORKER_KIND_DECODE, address=self.address,
                                    model_fingerprint=FINGERPRINT,
                                    free_slots=self.knobs.free_slots, total_slots=16,
                                    free_pages=self.knobs.free_pages, total_pages=128)


@dataclass
class FakeWorker:
    kind: str
    server: grpc.aio.Server
    servicer: FakePrefill | FakeDecode
    address: str = field(default="")

    async def stop(self) -> None:
        await self.server.stop(0)


async def start_fake(kind: str, host: str = "127.0.0.1", port: int = 0) -> FakeWorker:
    """A fake worker serving on host:port (0 = any free port)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)  # the real workers' options (keepalive)
    servicer: FakePrefill | FakeDecode
    if kind == "prefill":
        servicer = FakePrefill()
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    else:
        servicer = FakeDecode()
        decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    servicer.address = f"{host}:{bound}"
    return FakeWorker(kind, server, servicer, servicer.address)
