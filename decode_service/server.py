"""The Decode servicer: validates and lands handoffs, streams tokens, aborts, reports load.

``build_decode_service`` wires the parts: the engine thread, the token streams, and for the
``tcp`` transport the handoff listener, which owns the host buffers its frames are read into
(pinned when the pools are on a GPU) and closes them when it closes, after its readers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError

from common import convert
from common.engine.llm_engine import LLMEngine, TokenEvent
from common.grpc_util import abort_if_engine_stopped, bind, make_server
from common.handoff.errors import HandoffError
from common.handoff.layout import LayoutDescriptor
from common.handoff.chunk_codec import RawChunk, decode_chunk
from common.handoff.parts import ChunkPart, HeaderPart, PoolCopyPart
from common.handoff.stream import HandoffAssembler
from common.limits import request_capacity_tokens
from common.load_report import LoadReport
from common.logging_setup import bind_request_id
from common.security import ServerSecurity
from common.shutdown import GracefulShutdown
from common.handoff.tcp_tls import server_context
from common.handoff.transports import shares_pools, takes_tcp
from common.pb.flashsplit.v1 import decode_pb2, decode_pb2_grpc, types_pb2
from decode_service.chunk_landings import ChunkLandings
from decode_service.engine import DecodeEngine
from decode_service.peer_pools import PeerPools
from decode_service.rank_streams import DecodeRankStreams, open_rank_streams
from decode_service.streams import TokenStreams
from decode_service.tcp_feed import TcpFeed
from decode_service.tcp_listener import TcpHandoffListener

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DecodeEngine, streams: TokenStreams, layout: LayoutDescriptor,
                 fingerprint: str, address: str, max_handoff_bytes: int,
                 shutdown: GracefulShutdown | None = None,
                 transport: str = "auto", idle_timeout_s: float = 60.0,
                 tcp: TcpHandoffListener | None = None, open_peer_pools: bool = True,
                 rank_streams: DecodeRankStreams | None = None) -> None:
        self.engine = engine
        # per-rank streams (None: every handoff lands on this rank, scattered if sharded)
        self.rank_streams = rank_streams
        # longer than any wait between two parts of a live handoff: a prompt queued on its
        # prefill worker, or the longest prefill chunk
        self.idle_timeout_s = idle_timeout_s
        # "stream" takes bytes only; "auto" and "device" open a same-host sender's pools
        # a sharded worker (--tp) opens none: its pools hold only its heads
        self.peers = PeerPools(open_peer_pools and shares_pools(transport), engine.pools)
        # where chunks may come beside the stream ("auto" and "tcp"; None: on the stream only)
        self.tcp = tcp
        self.shutdown = shutdown or GracefulShutdown("decode worker")
        self.streams = streams
        self.layout = layout
        self.fingerprint = fingerprint
        self.address = address
        self.max_handoff_bytes = max_handoff_bytes
        self.metrics = engine.metrics
        # lands chunk bytes (checksum, copy into the pools), several chunks of a handoff at once
        # one torch CPU thread each: a landing is a copy, and an OpenMP team per writer thread
        # would take cores from the engine thread's steps (on the CPU)
        self.writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="handoff-writer",
                                         initializer=torch.set_num_threads, initargs=(1,))

    async def _reserve(self, header: HeaderPart, source, rank_ticket: bytes | None = None):
        """Room for a checked header, taken on the engine thread."""
        if self.streams.is_aborted(header.handoff_id):
            raise HandoffError("ABORTED", f"handoff {header.handoff_id} was aborted")
        future = self.engine.reserve(header, source, rank_ticket)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # the engine may be taking the room right now: give it back once it has
            future.add_done_callback(_release_if_reserved)
            raise

    async def _freed(self) -> None:
        """Wait until room given back so far is free again: frees run as engine commands, in
        order, so a status answered after this finds the pools as they will stay."""
        await asyncio.wrap_future(self.engine.call(lambda: None))

    async def Handoff(self, request_iterator, context):
        assembler = HandoffAssembler(self.layout, self.fingerprint, self.max_handoff_bytes,
                                     reserve=None)
        loop = asyncio.get_running_loop()
        landings = ChunkLandings(assembler, self.writer)
        reservation = None
        rank_ticket = None  # when the state comes on per-rank streams
        feed: TcpFeed | None = None  # when the chunks come over TCP
        banded_bytes = 0
        began = time.perf_counter()  # the header is the call's first message
        try:
            async for message in _until_idle(
                    request_iterator, self.idle_timeout_s,
                    lambda: feed.last_frame if feed is not None else None):
                raw = decode_chunk(message)
                part = _handoff_part(message, raw)
                if isinstance(part, HeaderPart):
                    assembler.check_header(part)
                    bind_request_id(part.spec.request_id)
                    source = await loop.run_in_executor(self.writer, self.peers.open,
                                                        part.source_pools)
                    ranks = self.rank_streams
                    if source is None and ranks is not None and ranks.takes(part.rank_streams):
                        rank_ticket = ranks.new_ticket()
                    room = await self._reserve(part, source, rank_ticket)
                    # a request decoded without the draft needs no draft context: not sent
                    declined = frozenset({"dflash_context"} & set(part.manifest)
                                         if not room.has_draft_context else ())
                    assembler.start(part, room, pool_copies=source is not None,
                                    bands=(ranks.band_names(part.rank_streams)
                                           if rank_ticket is not None else None),
                                    declined=declined)
                    accepted = decode_pb2.HandoffAccepted(
                        handoff_id=part.handoff_id, pool_copies=source is not None,
                        without_draft_context=bool(declined))
                    if rank_ticket is not None:
                        # no prefill rank may send before every rank takes the ticket
                        await ranks.ready(rank_ticket, self.idle_timeout_s)
                        accepted.rank_ports.extend(ranks.ports)
                        accepted.rank_ticket = rank_ticket
                    if source is None and self.tcp is not None:
                        feed = TcpFeed(self.tcp.offer(loop), landings)
                        feed.start()
                        accepted.tcp_port, accepted.tcp_ticket = feed.offer.port, \
                            feed.offer.ticket
                    # room is held: only now does the sender prefill and write the payload
                    yield decode_pb2.HandoffReply(accepted=accepted)
                    continue
                header = assembler.header
                if header is not None and self.streams.is_aborted(header.handoff_id):
                    raise HandoffError("ABORTED", f"handoff {header.handoff_id} was aborted")
                if isinstance(part, ChunkPart):
                    if feed is not None:
                        if feed.active:
                            raise HandoffError("INVALID_ARGUMENT", "chunks on the stream and "
                                               "over TCP in one handoff")
                        # the sender could not reach our listener: its bytes come here
                        await feed.stop()
                        feed.offer.withdraw()  # frames after this are dropped
                        feed = None
                    # checksum and copy on writer threads while the next chunks arrive: other
                    # handoffs and token streams share the event loop
                    await landings.add(part, message, raw)
                elif isinstance(part, PoolCopyPart):
                    # run on a writer thread while the next part is read (one hop, not one each)
                    await landings.add_pool_copy(part)
                else:
                    if part.tcp_chunks and feed is None:
                        raise HandoffError("INVALID_ARGUMENT", "the trailer counts TCP chunks, "
                                           "but this handoff was not offered TCP")
                    if feed is not None:
                        await feed.wait_for(part.tcp_chunks, self.idle_timeout_s)
                    await landings.drain()  # the trailer's checks need every chunk's CRC
                    if part.rank_chunks and rank_ticket is None:
                        raise HandoffError("INVALID_ARGUMENT", "the trailer counts per-rank "
                                           "frames, but this handoff was not given ranks")
                    assembler.on_part(part)
                    if rank_ticket is not None:
                        banded_bytes = await self.rank_streams.verify(
                            rank_ticket, assembler.header.rank_streams, part,
                            self._complete_followers(rank_ticket), self.idle_timeout_s)
            await landings.drain()
            # DATA_LOSS if the stream ended before the trailer; else the verified reservation
            reservation = assembler.on_end()
            await asyncio.wrap_future(self.engine.admit(reservation, assembler.first_token,
                                                        assembler.first_logprobs))
        except HandoffError as exc:
            self.metrics.handoff_ended(exc.code)
            if feed is not None:
                await feed.stop()
                feed.offer.withdraw()  # its frames still coming are dropped, never block
            await landings.settle()
            if reservation is not None:
                reservation.release()
            assembler.abort()
            await self._freed()
            log.info("handoff refused: %s", exc)
            if assembler.header is not None and exc.code != "DEADLINE_EXCEEDED":
                # NOTE: the sender is mid-payload; ending the call under its writes would make
                # its side report INTERNAL instead of this status, so read the rest first.
                async for _ in request_iterator:
                    pass
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        except BaseException as exc:
            # cancelled by the sender, or a bug: either way free what was held, once no
            # writer thread still lands bytes in it
            self.metrics.handoff_ended("UNKNOWN" if isinstance(exc, Exception) else "CANCELLED")
            if feed is not None:
                await asyncio.shield(feed.stop())
            await landings.settle()
            if reservation is not None:
                reservation.release()
            assembler.abort()
            raise
        finally:
            if feed is not None:
                feed.offer.withdraw()
        received = assembler.bytes_received + banded_bytes
        self.metrics.handoff_admitted(received, time.perf_counter() - began)
        log.info("handoff %016x admitted: %d prompt tokens, %d bytes, %s",
                 assembler.header.handoff_id, assembler.header.prompt_len, received,
                 "on per-rank streams" if rank_ticket is not None else "through rank 0")
        yield decode_pb2.HandoffReply(ack=decode_pb2.HandoffAck(
            handoff_id=assembler.header.handoff_id, bytes_received=received))

    def _complete_followers(self, ticket: bytes):
        async def complete(frames: tuple[int, ...]) -> None:
            await asyncio.wrap_future(self.engine.complete_bands(ticket, frames,
                                                                 self.idle_timeout_s))
        return complete

    async def Stream(self, request: decode_pb2.StreamRequest, context):
        handoff_id = request.handoff_id
        try:
            queue = self.streams.subscribe(handoff_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        finished = False
        try:
            while not finished:
                try:
                    with self.shutdown.cancelled_at_expiry():
                        first = await queue.get()
                except asyncio.CancelledError:
                    if not self.shutdown.expired.is_set():
                        raise
                    # the shutdown grace is over: end with ABORT; the finally frees the request
                    yield decode_pb2.TokenEvent(finish_reason=convert.finish_reason_to_pb("abort"),
                                                error=self.shutdown.message)
                    return
                events: list[TokenEvent] = [first]
                while not queue.empty():  # coalesce what the engine produced meanwhile
                    events.append(queue.get_nowait())
                tokens = [e.token_id for e in events if e.token_id >= 0]
                last = events[-1].finish_reason
                finished = last is not None
                yield decode_pb2.TokenEvent(
                    token_ids=tokens, finish_reason=convert.finish_reason_to_pb(last),
                    accept_lengths=[e.accept_length for e in events
                                    if e.accept_length is not None],
                    error="decode engine failed" if last == "error" else "",
                    logprobs=[convert.logprobs_to_pb(e.logprobs) for e in events
                              if e.token_id >= 0 and e.logprobs is not None])
        finally:
            self.streams.close(handoff_id)
            if not finished:
                # the router went away or cancelled: stop generating and free the cache
                self.streams.mark_aborted(handoff_id)
                self.engine.abort(handoff_id)

    async def Abort(self, request: types_pb2.AbortRequest, context) -> types_pb2.AbortResponse:
        self.streams.mark_aborted(request.handoff_id)
        found = await asyncio.wrap_future(self.engine.abort(request.handoff_id))
        if found:
            self.streams.post([TokenEvent(str(request.handoff_id), -1, "abort")])
        log.info("abort handoff %d (%s): found=%s", request.handoff_id, request.reason, found)
        return types_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> types_pb2.LoadReport:
        await abort_if_engine_stopped(self.engine, context)
        load = self.engine.load()
        return convert.load_report_to_pb(LoadReport(
            kind="decode", address=self.address, model_fingerprint=self.fingerprint,
            free_pages=load["free_pages"], total_pages=load["total_pages"],
            free_slots=load["free_slots"], total_slots=load["total_slots"],
            queue_len=load["waiting"], running=load["running"],
            # DFLASH totals (spec_steps, spec_committed_tokens, spec_drafted_tokens) appear only
            # on a worker with a draft; mean acceptance = committed / steps
            counters=self.metrics.load_counters(),
            max_request_tokens=request_capacity_tokens(self.engine.engine)))


def _release_if_reserved(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().release()


@dataclass
class DecodeService:
    """A decode worker's parts, wired and bound but not started (``server.start()`` does)."""

    server: grpc.aio.Server
    health: object
    engine: DecodeEngine
    address: str
    shutdown: GracefulShutdown
    tcp: TcpHandoffListener | None = None  # the tcp transport's listener
    rank_streams: DecodeRankStreams | None = None

    async def stop(self) -> None:
        await self.server.stop(0)
        self.close_tcp()
        self.engine.stop()

    def close_tcp(self) -> None:
        if self.rank_streams is not None:
            self.rank_streams.close()
        if self.tcp is not None:
            self.tcp.close()


def build_decode_service(llm: LLMEngine, layout: LayoutDescriptor, fingerprint: str, *,
                         host: str = "127.0.0.1", port: int = 0,
                         max_handoff_bytes: int = 8 << 30,
                         security: ServerSecurity = ServerSecurity(),
                         transport: str = "auto",
                         idle_timeout_s: float = 60.0,
                         handoff_port: int = 0,
                         open_peer_pools: bool = True,
                         rank_streams: bool = False,
                         band_token: str | None = None) -> DecodeService:
    """Engine thread (started), token streams and servicer on a bound server that demands
    ``security`` (docs/security.md). Call from the event loop that will serve it: the streams
    post engine events to that loop. Raises OSError when the port cannot be bound."""
    # bound first: a port in use fails here, before an engine thread exists
    shutdown = GracefulShutdown("decode worker")
    server, health = make_server([*security.interceptors(), shutdown.interceptor()])
    address = bind(server, host, port, security.credentials())
    # frames are read into pinned buffers where the pools are on a GPU: their copies into
    # the pools are then truly asynchronous, on each reservation's copy stream
    tcp = (TcpHandoffListener(host, handoff_port, security.accepts,
                              pin_memory=llm.kv_pool.kv.device.type == "cuda",
                              ssl_context=None if security.tls is None
                              else server_context(security.tls, security.require_client_cert))
           if takes_tcp(transport) else None)
    ranks = open_rank_streams(llm, tcp, host, band_token) if rank_streams and tcp else None
    streams = TokenStreams(asyncio.get_running_loop())
    engine = DecodeEngine(llm, streams.post, ranks.receiver if ranks is not None else None)
    engine.start()
    add_decode_servicer(DecodeServicer(engine, streams, layout, fingerprint, address,
                                       max_handoff_bytes=max_handoff_bytes, shutdown=shutdown,
                                       transport=transport, idle_timeout_s=idle_timeout_s,
                                       tcp=tcp, open_peer_pools=open_peer_pools,
                                       rank_streams=ranks),
                        server)
    return DecodeService(server, health, engine, address, shutdown, tcp, ranks)


async def _until_idle(messages, timeout_s: float,
                      last_frame: Callable[[], float | None] = lambda: None):
    """``messages``, ending the handoff with DEADLINE_EXCEEDED when the sender sends nothing
    for ``timeout_s``: a header whose payload never comes must not hold its room for ever.
    ``last_frame()`` is when the handoff's latest chunk came over TCP (None: none did): a
    stream that is quiet while its chunks arrive there is not idle."""
    iterator = messages.__aiter__()
    while True:
        pending = asyncio.ensure_future(iterator.__anext__())
        try:
            while not (await asyncio.wait({pending}, timeout=timeout_s))[0]:
                last = last_frame()
                if last is None or time.monotonic() - last >= timeout_s:
                    raise HandoffError("DEADLINE_EXCEEDED", f"the sender sent nothing for "
                                       f"{timeout_s} s; the room held for the handoff is "
                                       "released")
        finally:
            if not pending.done():
                pending.cancel()
        try:
            message = pending.result()
        except StopAsyncIteration:
            return
        yield message


def _handoff_part(message: bytes, raw: RawChunk | None):
    """One ``Decode.Handoff`` message, as it came off the wire, as a handoff part. A chunk is
    read in place (``raw``, from ``chunk_codec.decode_chunk``: its data a view of the message):
    protobuf would copy its megabytes twice, at about 0.4 GB/s. Anything else goes through
    protobuf."""
    if raw is not None:
        return ChunkPart(field=raw.field, layer=raw.layer, offset=raw.offset, data=raw.data)
    try:
        return convert.handoff_part_from_pb(decode_pb2.HandoffMessage.FromString(message))
    except DecodeError:
        raise HandoffError("INVALID_ARGUMENT", "malformed handoff message") from None
    except ValueError as exc:
        raise HandoffError("INVALID_ARGUMENT", str(exc)) from None


def add_decode_servicer(servicer: DecodeServicer, server: grpc.aio.Server) -> None:
    """``decode_pb2_grpc.add_DecodeServicer_to_server``, but ``Handoff`` takes its messages
    as bytes (``_handoff_part`` parses them)."""
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Handoff": grpc.stream_stream_rpc_method_handler(
            servicer.Handoff, request_deserializer=None,
            response_serializer=decode_pb2.HandoffReply.SerializeToString),
        "Stream": grpc.unary_stream_rpc_method_handler(
            servicer.Stream, request_deserializer=decode_pb2.StreamRequest.FromString,
            response_serializer=decode_pb2.TokenEvent.SerializeToString),
        "Abort": unary(servicer.Abort, request_deserializer=types_pb2.AbortRequest.FromString,
                       response_serializer=types_pb2.AbortResponse.SerializeToString),
        "GetLoad": unary(servicer.GetLoad, request_deserializer=types_pb2.LoadRequest.FromString,
                         response_serializer=types_pb2.LoadReport.SerializeToString),
    }
    service = decode_pb2.DESCRIPTOR.services_by_name["Decode"]
    missing = {m.name for m in service.methods} - set(handlers)
    if missing:  # a method added to the proto must be added here too
        raise RuntimeError(f"Decode methods without a handler: {sorted(missing)}")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
