"""Streams a :class:`HandoffPayload` to a decode worker over ``Decode.Handoff``."""

from __future__ import annotations

import grpc

from common import convert
from common.grpc_util import CHANNEL_OPTIONS, send_stream
from common.handoff.payload import HandoffPayload
from common.handoff.stream import split_payload
from common.pb.flashsplit.v1 import decode_pb2_grpc


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

    async def send(self, address: str, payload: HandoffPayload):
        """Stream the payload; returns decode's ack or raises ``grpc.aio.AioRpcError``."""
        messages = (convert.handoff_part_to_pb(part)
                    for part in split_payload(payload, chunk_bytes=self.chunk_bytes))
        return await send_stream(self._stub(address).Handoff(timeout=self.timeout_s), messages)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
