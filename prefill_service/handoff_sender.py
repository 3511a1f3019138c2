"""The sender's half of ``Decode.Handoff``, streaming a prompt's state while it is computed.

A :class:`HandoffStream` opens the call before the prompt is prefilled: the header goes out
first and the decode worker answers ``accepted`` once it holds room, so a full or refusing
decode worker costs no prefill. Then each :class:`StateReady` the engine reports is read out of
the pools and written as chunks (KV pages of each finished chunk while the next one computes,
then the GDN state), and the trailer carries the checksums and the first token.

Reading and encoding run on a thread of the sender's pool, never on the engine thread nor the
event loop; the loop only writes the encoded messages.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from common import convert
from common.channels import ChannelSecurity, make_channel
from common.handoff.ledger import LayerLedger
from common.handoff.parts import HeaderPart, TrailerPart
from common.pb.flashsplit.v1 import decode_pb2, decode_pb2_grpc
from prefill_service.engine import StateReady
from prefill_service.state_reader import PromptShape, StateReader

HANDOFF_METHOD = "/flashsplit.v1.Decode/Handoff"
DEFAULT_CHUNK_BYTES = 4 << 20


async def _reply(call, expected: str) -> decode_pb2.HandoffReply:
    reply = await call.read()  # raises AioRpcError when the worker ended the call with a status
    if reply is grpc.aio.EOF or reply.WhichOneof("reply") != expected:
        await call.code()
        raise RuntimeError(f"decode worker broke the handoff protocol: expected {expected!r}, "
                           f"got {reply!r}")
    return reply


async def send_handoff(stub: decode_pb2_grpc.DecodeStub, messages,
                       timeout_s: float) -> decode_pb2.HandoffAck:
    """A whole handoff whose messages exist already (a payload in memory: benchmarks, tests):
    the header, then wait for ``accepted`` (a refusal raises here, before any payload byte is
    sent), then the rest, then wait for the ``ack``.

    Raises ``grpc.aio.AioRpcError`` with the decode worker's status.
    """
    call = stub.Handoff(timeout=timeout_s)
    messages = iter(messages)
    first = next(messages, None)
    if first is None:
        raise ValueError("a handoff needs at least a header")
    await call.write(first)
    await _reply(call, "accepted")
    for message in messages:
        await call.write(message)
    await call.done_writing()
    return (await _reply(call, "ack")).ack


class HandoffStream:
    """One request's handoff: :meth:`open`, then :meth:`send` for each ready part (the last
    one has the first token), then :meth:`finish`. Cancelling the task that runs it (or
    :meth:`cancel`) ends the call, and the decode worker frees its reservation."""

    def __init__(self, call, header: HeaderPart, reader: StateReader,
                 executor: ThreadPoolExecutor) -> None:
        self._call = call
        self.header = header
        self._reader = reader
        self._executor = executor
        self._prompt = PromptShape(header.prompt_len, header.layout.page_size)
        self._ledgers = {(name, layer): LayerLedger(spec.layer_nbytes)
                         for name, spec in header.manifest.items()
                         for layer in range(spec.num_layers)}
        self._pages_sent = 0
        self.bytes_sent = 0
        self.send_s = 0.0  # time spent sending after the prompt finished (not hidden)

    async def open(self) -> None:
        """Write the header and wait for ``accepted``; raises AioRpcError on a refusal."""
        await self._call.write(convert.handoff_part_to_pb(self.header).SerializeToString())
        await _reply(self._call, "accepted")

    async def send(self, ready: StateReady) -> None:
        """Stream the part of the state ``ready`` says is final and not yet sent."""
        loop = asyncio.get_running_loop()
        start, self._pages_sent = self._pages_sent, max(self._pages_sent, ready.num_pages)
        messages = await loop.run_in_executor(
            self._executor, self._reader.pages, ready, start, self._prompt, self._ledgers)
        if ready.final:
            messages += await loop.run_in_executor(
                self._executor, self._reader.states, ready, self._ledgers)
        for message in messages:
            self.bytes_sent += len(message)
            await self._call.write(message)

    async def finish(self, first_token: int) -> decode_pb2.HandoffAck:
        """Write the trailer, close, and wait for decode's ``ack`` (the request is admitted)."""
        checksums = {}
        for name, spec in self.header.manifest.items():
            crc = 0
            for layer in range(spec.num_layers):
                crc = self._ledgers[(name, layer)].fold(crc, f"{name} layer {layer}")
            checksums[name] = crc
        trailer = TrailerPart(checksums=checksums, first_token=first_token)
        await self._call.write(convert.handoff_part_to_pb(trailer).SerializeToString())
        await self._call.done_writing()
        return (await _reply(self._call, "ack")).ack

    async def run(self, ready_parts: asyncio.Queue) -> decode_pb2.HandoffAck:
        """Send every part from ``ready_parts`` until the final one, then finish."""
        while True:
            ready: StateReady = await ready_parts.get()
            started = time.perf_counter()
            await self.send(ready)
            if ready.final:
                ack = await self.finish(ready.first_token)
                self.send_s = time.perf_counter() - started
                return ack

    def cancel(self) -> None:
        self._call.cancel()


class HandoffSender:
    """One cached channel per decode address; every call has a deadline and ``security``'s
    token (and TLS). Messages are written pre-encoded (``common/handoff/wire.py``)."""

    def __init__(self, reader: StateReader, *, timeout_s: float = 120.0,
                 security: ChannelSecurity = ChannelSecurity()) -> None:
        self.reader = reader
        self.security = security
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="handoff-reader")

    def stream(self, address: str, header: HeaderPart) -> HandoffStream:
        """A handoff to ``address``, not yet opened."""
        channel = self._channels.get(address)
        if channel is None:
            channel = make_channel(address, self.security)
            self._channels[address] = channel
        handoff = channel.stream_stream(HANDOFF_METHOD, request_serializer=None,
                                        response_deserializer=decode_pb2.HandoffReply.FromString)
        return HandoffStream(handoff(timeout=self.timeout_s), header, self.reader,
                             self._executor)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
