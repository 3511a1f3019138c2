"""The prefill worker's handoff calls: :class:`HandoffSender` makes one
:class:`~prefill_service.handoff_stream.HandoffStream` per request, over a cached channel per
decode address or through the send process, and :func:`send_handoff` sends a whole handoff
whose messages exist already (benchmarks, tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from common.auth import TOKEN_HEADER
from common.channels import ChannelSecurity, make_channel
from common.handoff.tcp_tls import client_context
from common.handoff.transports import takes_tcp
from common.handoff.parts import HeaderPart
from common.pb.flashsplit.v1 import decode_pb2, decode_pb2_grpc
from prefill_service.handoff_stream import HandoffStream, read_reply
from prefill_service.leader_bands import PrefillRankStreams
from prefill_service.message_feed import feed_from_thread
from prefill_service.process_call import SendProcess, SendProcessConfig
from prefill_service.shared_pools import SharedPools
from prefill_service.state_reader import StateReader
from prefill_service.tcp_connections import TcpConnections

log = logging.getLogger(__name__)

HANDOFF_METHOD = "/flashsplit.v1.Decode/Handoff"
DEFAULT_CHUNK_BYTES = 4 << 20
# room for a chunk message's fields before its data (a send process's slot holds both)
CHUNK_PREFIX_BYTES = 256
SENDERS = ("auto", "thread", "process")


def uses_send_process(sender: str, transport: str, device: str) -> bool:
    """Whether a prefill worker's handoff calls go through a send process: ``process``
    always, ``thread`` never, ``auto`` for the ``stream`` transport on a GPU (where gRPC's
    copies of the chunks slowed the prefill beside them; on a CPU worker the process would
    take a core from the forward instead)."""
    if sender not in SENDERS:
        raise ValueError(f"unknown handoff sender {sender!r}; expected one of {SENDERS}")
    if sender == "auto":
        return transport == "stream" and device.startswith("cuda")
    return sender == "process"


async def send_handoff(stub: decode_pb2_grpc.DecodeStub, messages,
                       timeout_s: float, executor: ThreadPoolExecutor | None = None
                       ) -> decode_pb2.HandoffAck:
    """A whole handoff whose messages exist already or are made as they are pulled (a payload
    in memory: benchmarks, tests): the header, then wait for ``accepted`` (a refusal raises
    here, before any payload byte is sent), then the rest, then wait for the ``ack``. With an
    ``executor``, the rest of ``messages`` is pulled on it while the loop writes.

    Raises ``grpc.aio.AioRpcError`` with the decode worker's status.
    """
    call = stub.Handoff(timeout=timeout_s)
    messages = iter(messages)
    first = next(messages, None)
    if first is None:
        raise ValueError("a handoff needs at least a header")
    await call.write(first)
    await read_reply(call, "accepted")
    if executor is None:
        for message in messages:
            await call.write(message)
    else:
        async with contextlib.aclosing(feed_from_thread(executor, lambda: messages)) as rest:
            async for message in rest:
                await call.write(message)
    await call.done_writing()
    return (await read_reply(call, "ack")).ack


class HandoffSender:
    """One cached channel per decode address; every call has a deadline and ``security``'s
    token (and TLS). Messages are written pre-encoded (``common/handoff/chunk_codec.py``).
    With a ``send_process`` the calls are made there (``prefill_service/send_process.py``):
    gRPC's copy of each chunk then holds that process's GIL, not this one's."""

    def __init__(self, reader: StateReader, *, timeout_s: float = 120.0,
                 security: ChannelSecurity = ChannelSecurity(), transport: str = "stream",
                 shared: SharedPools | None = None, tcp_connections: int | None = None,
                 rank_streams: PrefillRankStreams | None = None,
                 send_process: bool = False,
                 send_process_started: Callable[[], None] = lambda: None) -> None:
        if tcp_connections is not None and tcp_connections < 1:
            raise ValueError(f"--handoff-tcp-connections must be >= 1, got {tcp_connections}")
        if transport == "device" and shared is None:
            raise ValueError("--handoff-transport device needs the pools shared")
        self.reader = reader
        self.transport = transport
        self.shared = shared
        self.security = security
        self.timeout_s = timeout_s
        self.tcp_connections = tcp_connections
        self.rank_streams = rank_streams  # None: handoffs never take per-rank streams
        # made here, started on the first handoff (or by ``start``)
        self.send_process = (SendProcess(SendProcessConfig(
            reader.chunk_bytes + CHUNK_PREFIX_BYTES), security, send_process_started)
            if send_process else None)
        self._channels: dict[str, grpc.aio.Channel] = {}
        # chunks over TCP carry the same token as the calls, and TLS where the calls have it
        self.tcp = (TcpConnections(dict(security.metadata).get(TOKEN_HEADER),
                                   ssl_context=None if security.tls is None
                                   else client_context(security.tls))
                    if takes_tcp(transport) else None)
        # each handoff's reads (and, over TCP, its writes) run on one of these at a time
        # one torch CPU thread each: their gathers are copies, and an OpenMP team per sender
        # thread would take cores from the engine thread's forward (on the CPU)
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="handoff-sender",
                                            initializer=torch.set_num_threads, initargs=(1,))

    def start(self) -> None:
        """Starts the send process, if any (on the event loop), before the first handoff."""
        if self.send_process is not None:
            self.send_process.start()

    def stream(self, address: str, header: HeaderPart) -> HandoffStream:
        """A handoff to ``address``, not yet opened."""
        reply = decode_pb2.HandoffReply.FromString
        if self.send_process is not None:
            call = self.send_process.call(address, HANDOFF_METHOD, self.timeout_s, reply)
        else:
            channel = self._channels.get(address)
            if channel is None:
                channel = make_channel(address, self.security)
                self._channels[address] = channel
            call = channel.stream_stream(HANDOFF_METHOD, request_serializer=None,
                                         response_deserializer=reply)(timeout=self.timeout_s)
        if self.shared is not None:  # offer our pools: a receiver on this host copies them
            header = dataclasses.replace(header, source_pools=self.shared.handles_for(address))
        if self.rank_streams is not None:  # offer each rank's heads on streams of their own
            header = dataclasses.replace(header, rank_streams=self.rank_streams.tp_size)
        return HandoffStream(call, header, self.reader, self._executor, address=address,
                             transport=self.transport, tcp=self.tcp,
                             tcp_connections=self.tcp_connections,
                             rank_streams=self.rank_streams,
                             by_send_process=self.send_process is not None)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self.send_process is not None:  # it cancels what is open and exits: a short wait
            await asyncio.to_thread(self.send_process.close)
        if self.tcp is not None:
            self.tcp.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.reader.close()
        if self.rank_streams is not None:
            self.rank_streams.sender.close()
        if self.shared is not None:
            self.shared.close()
