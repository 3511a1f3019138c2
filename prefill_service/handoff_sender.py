"""Streams a :class:`HandoffPayload` to a decode worker over ``Decode.Handoff``."""

from __future__ import annotations

import grpc

from common import convert
from common.grpc_util import CHANNEL_OPTIONS
from common.handoff.payload import HandoffPayload
from common.handoff.stream import split_payload
from common.pb.flashsplit.v1 import decode_pb2, decode_pb2_grpc


async def send_handoff(stub: decode_pb2_grpc.DecodeStub, messages,
                       timeout_s: float) -> decode_pb2.HandoffAck:
    """The sender's half of ``Decode.Handoff``: the header, then wait for ``accepted`` (a refusal
    raises here, before any payload byte is sent), then the rest, then wait for the ``ack``.

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


async def _reply(call, expected: str) -> decode_pb2.HandoffReply:
    reply = await call.read()  # raises AioRpcError when the worker ended the call with a status
    if reply is grpc.aio.EOF or reply.WhichOneof("reply") != expected:
        await call.code()
        raise RuntimeError(f"decode worker broke the handoff protocol: expected {expected!r}, "
                           f"got {reply!r}")
    return reply


class HandoffSender:
    """One cached channel per decode address; every call has a deadline."""

    def __init__(self, *, chunk_bytes: int = 1 << 20, timeout_s: float = 120.0) -> None:
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return decode_pb2_grpc.DecodeStub(channel)

    async def send(self, address: str, payload: HandoffPayload) -> decode_pb2.HandoffAck:
        """Stream the payload; returns decode's ack or raises ``grpc.aio.AioRpcError``."""
        messages = (convert.handoff_part_to_pb(part)
                    for part in split_payload(payload, chunk_bytes=self.chunk_bytes))
        return await send_handoff(self._stub(address), messages, timeout_s=self.timeout_s)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
