"""One request's handoff, streamed while its prompt is computed: :class:`HandoffStream`.

It opens the call before the prompt is prefilled: the header goes out first and the decode
worker answers ``accepted`` once it holds room, so a full or refusing decode worker costs no
prefill. Then each :class:`StateReady` the engine reports is read out of the pools and written
as chunks (KV pages of each finished chunk while the next one computes, then the GDN state),
and the trailer carries the checksums and the first token.

Reading and encoding run on a thread of the sender's pool, never on the engine thread nor the
event loop; the loop only writes the encoded messages (through a send process, the reading
thread writes them too: only their slots' numbers leave this process). The calls themselves
come from ``prefill_service/handoff_sender.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from common import convert
from common.handoff.tcp_frames import tcp_host
from common.handoff.ledger import fold_checksums, new_ledgers
from common.handoff.parts import HeaderPart, PoolCopyPart, TrailerPart
from common.logprobs import TokenLogprobs
from common.pb.flashsplit.v1 import decode_pb2
from common.parallel.rank_streams import RankStreamPlan
from prefill_service.engine import StateReady
from prefill_service.leader_bands import (LeaderBands, PrefillRankStreams, RankStreamsRefused,
                                          take_plan, unbanded)
from prefill_service.message_feed import feed_from_thread
from prefill_service.state_reader import PromptShape, StateReader
from prefill_service.tcp_connections import TcpConnection, TcpConnections, send_chunks

log = logging.getLogger(__name__)

# ``tcp``: a handoff of at least this many payload bytes takes a second connection unless
# --handoff-tcp-connections says how many. On the H200 a second one halved the tail of 305 and
# 1,073 MiB handoffs (8k and 32k tokens of the 4B shape) and slowed 113 MiB ones (2k), whose
# prefill it slowed more than it sped their bytes (docs/handoff_performance.md, run H)
SECOND_TCP_CONNECTION_BYTES = 192 << 20

def tcp_connections_for(payload_bytes: int, asked: int | None) -> int:
    """How many TCP connections a handoff of ``payload_bytes`` takes: ``asked``, or by its
    size when None (``SECOND_TCP_CONNECTION_BYTES``)."""
    if asked is not None:
        return asked
    return 2 if payload_bytes >= SECOND_TCP_CONNECTION_BYTES else 1


async def read_reply(call, expected: str) -> decode_pb2.HandoffReply:
    """The next reply of a handoff call, which must be ``expected`` (``accepted`` or ``ack``)."""
    reply = await call.read()  # raises AioRpcError when the worker ended the call with a status
    if reply is grpc.aio.EOF or reply.WhichOneof("reply") != expected:
        await call.code()
        raise RuntimeError(f"decode worker broke the handoff protocol: expected {expected!r}, "
                           f"got {reply!r}")
    return reply


class HandoffTransportError(Exception):
    """``--handoff-transport device`` or ``tcp`` was asked for, and the receiver cannot do
    it."""


class HandoffStream:
    """One request's handoff: :meth:`open`, then :meth:`send` for each ready part (the last
    one has the first token), then :meth:`finish`. Cancelling the task that runs it (or
    :meth:`cancel`) ends the call, and the decode worker frees its reservation."""

    def __init__(self, call, header: HeaderPart, reader: StateReader,
                 executor: ThreadPoolExecutor, *, address: str = "", transport: str = "stream",
                 tcp: TcpConnections | None = None, tcp_connections: int | None = None,
                 rank_streams: PrefillRankStreams | None = None,
                 by_send_process: bool = False) -> None:
        """``by_send_process``: ``call`` is a :class:`ProcessCall`, whose chunks are encoded
        into its shared slots and written by the sender thread that makes them."""
        self._call = call
        self.by_send_process = by_send_process
        self.header = header
        self._reader = reader
        self._executor = executor
        self._address = address
        self._transport = transport
        self._tcp = tcp
        self._tcp_count = tcp_connections
        self._prompt = PromptShape(header.prompt_len, header.layout.page_size)
        self._ledgers = new_ledgers(header.manifest)
        # what is sent: the header's manifest less what the receiver declined (set by open)
        self._manifest = header.manifest
        self._sent = {"kv": 0, "dflash_context": 0}  # pages sent of each paged field
        self._states_sent = False
        self.pool_copies = False  # the receiver opened our pools (set by open)
        self._connections: list[TcpConnection] = []  # chunks go over TCP (set by open)
        self._ticket = b""  # set by open when the chunks go over TCP
        self._stopped = threading.Event()  # tells a sending thread to stop at its next chunk
        self.tcp_chunks = 0
        self.bytes_sent = 0
        self._rank = rank_streams
        # per-rank streams, when the receiver took them (set by open): every rank sends its
        # own heads of kv, conv_state and ssm_state; this call carries the rest
        self._bands: LeaderBands | None = None

    @property
    def draft_declined(self) -> bool:
        """Whether the receiver decodes the request without the draft, so that its draft
        context is neither made nor sent (known once opened)."""
        return "dflash_context" in self.header.manifest and "dflash_context" not in self._manifest

    @property
    def tcp_connection_count(self) -> int:
        """Connections this handoff's chunks are spread over (0: not over TCP)."""
        return len(self._connections)

    @property
    def rank_plan(self) -> RankStreamPlan | None:
        """The per-rank streams' plan, when this handoff takes them (known once opened)."""
        return self._bands.plan if self._bands is not None else None

    @property
    def over_tcp(self) -> bool:
        """Whether this handoff's chunks go on TCP connections (known once opened)."""
        return bool(self._ticket)

    async def open(self) -> None:
        """Write the header and wait for ``accepted``; raises AioRpcError on a refusal, and
        HandoffTransportError when the sender's transport is ``device`` or ``tcp`` and the
        receiver cannot take it. A receiver that decodes the request without the draft says
        so (``draft_declined`` then): its draft context is not sent. With ``tcp`` or ``auto``
        and a receiver that offers TCP, the connection is taken here; under ``auto`` one that
        cannot be made leaves the chunks on the stream."""
        await self._call.write(convert.handoff_part_to_pb(self.header).SerializeToString())
        accepted = (await read_reply(self._call, "accepted")).accepted
        self.pool_copies = accepted.pool_copies
        if accepted.without_draft_context:
            self._manifest = {name: spec for name, spec in self._manifest.items()
                              if name != "dflash_context"}
        if self._transport == "device" and not self.pool_copies:
            self._call.cancel()
            raise HandoffTransportError(
                "the decode worker cannot open this worker's pools (another host, the GPU not "
                "visible to it, or it runs --handoff-transport stream or tcp): use "
                "--handoff-transport auto or stream")
        why = "it offers no TCP listener (--handoff-transport stream or device, or TLS)"
        if not self.pool_copies and accepted.tcp_port and self._tcp is not None:
            why = await self._connect(accepted.tcp_port, accepted.tcp_ticket)
        if self._transport == "tcp" and not self._connections:
            self._call.cancel()
            raise HandoffTransportError(f"the decode worker takes no chunks over TCP: {why}; "
                                        "use --handoff-transport auto or stream")
        if self._rank is not None:  # per-rank streams, where the receiver listed its ranks
            try:
                plan = take_plan(self._rank, accepted, self._address, self.header)
            except RankStreamsRefused as exc:
                self._call.cancel()
                raise HandoffTransportError(str(exc)) from None
            if plan is not None:
                self._bands = LeaderBands(self._rank, plan, self.header.handoff_id,
                                          self._executor)

    async def _connect(self, port: int, ticket: bytes) -> str:
        """Take connections to the receiver's listener; says why not when none can be made."""
        host = tcp_host(self._address)
        if host is None:
            return f"{self._address!r} has no TCP host"
        loop = asyncio.get_running_loop()

        count = tcp_connections_for(self.header.payload_nbytes, self._tcp_count)

        def acquire() -> list[TcpConnection]:
            connections = [self._tcp.acquire(host, port)]
            try:
                connections += [self._tcp.acquire(host, port) for _ in range(count - 1)]
            except OSError:
                pass  # fewer connections, same handoff
            return connections

        try:
            self._connections = await loop.run_in_executor(self._executor, acquire)
        except OSError as exc:
            if self._transport == "auto":
                log.warning("handoff to %s: no TCP connection to port %d (%s); its chunks go "
                            "on the stream", self._address, port, exc)
            return f"cannot connect to {host}:{port}: {exc}"
        self._ticket = ticket
        return ""

    async def send(self, ready: StateReady) -> None:
        """Stream the part of the state ``ready`` says is final and not yet sent (as pool
        copies when the receiver opened the pools). Chunks are read and encoded on a sender
        thread and written as each is made."""
        loop = asyncio.get_running_loop()
        if self.pool_copies and not ready.final:
            # a device copy of the whole prompt takes well under a millisecond: one at the end
            # costs less than a round of thread hand-offs per chunk
            return
        if self.pool_copies:
            start = self._sent["kv"]
            self._sent["kv"] = max(start, ready.num_pages)
            if ready.ready is None or ready.ready.query():
                # the step is over (a final report follows its sampling): no wait, no hop
                messages = self._copies(ready, start)
            else:
                messages = await loop.run_in_executor(self._executor, self._copies, ready,
                                                      start)
            for message in messages:
                self.bytes_sent += len(message)
                await self._call.write(message)
            return
        ranges = []  # (field, first page, end page) newly final
        fields = [] if self._bands is not None else [("kv", ready.num_pages)]
        if "dflash_context" in self._manifest:
            fields.append(("dflash_context", ready.final_draft_pages))
        for name, end in fields:
            start = self._sent[name]
            if end > start:
                ranges.append((name, start, end))
                self._sent[name] = end
        states = ready.final_states and not self._states_sent
        self._states_sent = self._states_sent or states
        if self._bands is not None:
            self._bands.queue(ready)
            states = False  # the GDN state is banded too: nothing of it goes on this call
            if not ranges:
                return

        if self._connections:
            # frames straight out of the pinned host buffers: no encoding copy
            await self._send_over_tcp(lambda: self._reader.frames(
                ready, ranges, states, self._prompt, self._ledgers))
            return

        if self.by_send_process:
            # encoded into the send process's slots and their numbers written by the reading
            # thread itself: no chunk passes through this event loop either
            self.bytes_sent += await loop.run_in_executor(
                self._executor, lambda: self._call.write_chunks(self._reader.read(
                    ready, ranges, states, self._prompt, self._ledgers,
                    self._call.encode_chunk)))
            return

        def produce():
            # in the order the forward writes them (each piece after its own layer's event)
            return self._reader.read(ready, ranges, states, self._prompt, self._ledgers)

        async with contextlib.aclosing(feed_from_thread(self._executor, produce)) as messages:
            async for message in messages:
                self.bytes_sent += len(message)
                await self._call.write(message)

    async def _send_over_tcp(self, produce) -> None:
        """Read ``produce()``'s frames on a sender thread and spread them over the
        connections, whose own threads write them: no chunk passes through the event loop."""
        connections, ticket, stopped = list(self._connections), self._ticket, self._stopped
        loop = asyncio.get_running_loop()
        try:
            sent, chunks = await loop.run_in_executor(
                self._executor, lambda: send_chunks(connections, ticket, produce(), stopped))
        except BaseException:
            # cancelled (the thread may still be writing: closing wakes it) or the write failed
            self._drop_connections()
            raise
        self.bytes_sent += sent
        self.tcp_chunks += chunks

    def _drop_connections(self) -> None:
        self._stopped.set()
        connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()

    def _copies(self, ready: StateReady, start: int) -> list[bytes]:
        """PoolCopy parts for what ``ready`` finished, once the step that wrote it is done on
        the device (the receiver reads our memory directly)."""
        if ready.ready is not None:
            ready.ready.synchronize()
        parts = []
        if ready.num_pages > start:
            pages = tuple(ready.page_ids[start:ready.num_pages])
            for name in ("kv", "dflash_context"):
                if name in self._manifest:
                    parts.append(PoolCopyPart(name, pages, start))
        if ready.final:
            parts += [PoolCopyPart("conv_state", (ready.slot,)),
                      PoolCopyPart("ssm_state", (ready.slot,))]
        return [convert.handoff_part_to_pb(p).SerializeToString() for p in parts]

    async def finish(self, first_token: int,
                     first_logprobs: TokenLogprobs | None = None) -> decode_pb2.HandoffAck:
        """Write the trailer, close, and wait for decode's ``ack`` (the request is admitted)."""
        # every field went as pool copies, or as bytes with a checksum
        manifest = self._manifest
        if self._bands is not None:  # these went as bands, checksummed by their senders
            manifest = unbanded(manifest)
        checksums = {} if self.pool_copies else fold_checksums(manifest, self._ledgers)
        rank_chunks: tuple[int, ...] = ()
        if self._bands is not None:
            sent = await self._bands.collect()
            checksums.update(sent.checksums)
            rank_chunks = sent.frames
            self.bytes_sent += sent.nbytes
        trailer = TrailerPart(checksums=checksums, first_token=first_token,
                              first_logprobs=first_logprobs, tcp_chunks=self.tcp_chunks,
                              rank_chunks=rank_chunks)
        connections, self._connections = self._connections, []
        for connection in connections:  # every chunk is written: the next handoff may use them
            self._tcp.release(connection)
        await self._call.write(convert.handoff_part_to_pb(trailer).SerializeToString())
        await self._call.done_writing()
        return (await read_reply(self._call, "ack")).ack

    async def run(self, ready_parts: asyncio.Queue) -> decode_pb2.HandoffAck:
        """Send every part from ``ready_parts`` until the final one, then finish."""
        while True:
            ready: StateReady = await ready_parts.get()
            await self.send(ready)
            if ready.final:
                return await self.finish(ready.first_token, ready.first_logprobs)

    def cancel(self) -> None:
        self._drop_connections()  # a no-op after finish, which gave it back
        if self._bands is not None:
            self._bands.drop()
        self._call.cancel()
