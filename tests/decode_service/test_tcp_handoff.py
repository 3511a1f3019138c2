"""Handoffs whose chunks come over TCP beside the stream: admitted, refused with the stream's
statuses, and never leaking room or the listener's frame buffers, against a real decode service
in this process."""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading

import grpc
import pytest

from common import convert
from common.handoff.chunk_codec import encode_chunk
from common.handoff.parts import ChunkPart, TrailerPart
from common.handoff.stream import split_payload
from common.handoff.tcp_frames import frame_header, hello
from common.pb.flashsplit.v1 import decode_pb2, types_pb2
from decode_service import chunk_landings
from prefill_service.handoff_sender import HANDOFF_METHOD
from prefill_service.handoff_stream import read_reply
from prefill_service.tcp_connections import TcpConnections, send_chunks
from tests.decode_service.test_handoff_validation import (EXPECTED, DecodeHarness, mutate, run,
                                                          tiny)  # noqa: F401

TCP_KINDS = ["unknown_field", "oversized_chunk", "layer_out_of_range", "duplicate_chunk",
             "missing_chunk", "bad_checksum", "corrupted_bytes"]


def _raw_call(h: DecodeHarness):
    """A Decode.Handoff call that takes pre-encoded messages, as the prefill worker's."""
    return h.channel.stream_stream(HANDOFF_METHOD, request_serializer=None,
                                   response_deserializer=decode_pb2.HandoffReply.FromString)(
        timeout=20)


async def _opened(h: DecodeHarness, header):
    """A raw call that has written ``header``, and the decode worker's acceptance."""
    call = _raw_call(h)
    await call.write(_wire(header))
    return call, (await read_reply(call, "accepted")).accepted


def _raw_connection(port: int) -> socket.socket:
    """A connection to the listener, past its hello (a cluster without a token)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(hello(None))
    assert sock.recv(1) == b"\x01"
    return sock


def _wire(part) -> bytes:
    if isinstance(part, ChunkPart):
        return encode_chunk(part.field, part.layer, part.offset, part.data)
    return convert.handoff_part_to_pb(part).SerializeToString()


async def buffers_back(h: DecodeHarness) -> None:
    """Every frame buffer is back in the listener's pool (a frame still on its way when its
    handoff ended is dropped a moment later), and no frame needed one of its own."""
    pool = h.service.tcp.buffers
    for _ in range(250):
        if pool.num_buffers == 0:
            break
        await asyncio.sleep(0.02)
    assert pool.num_buffers == 0 and pool.bytes_in_use == 0
    assert h.service.tcp.fresh_buffers == 0


async def send_over_tcp(h: DecodeHarness, parts, connections: TcpConnections, *,
                        on_stream=(), extra_frames=(), tcp_chunks=None) -> decode_pb2.HandoffAck:
    """The header and trailer on the call, the chunks as frames on two connections; the
    trailer counts ``tcp_chunks`` (default: the frames sent). ``on_stream`` chunks go in
    the call as well; ``extra_frames`` are raw frame bodies sent after the chunks."""
    header, *chunks, trailer = parts
    call, accepted = await _opened(h, header)
    assert accepted.tcp_port and len(accepted.tcp_ticket) == 16

    def send() -> int:
        held = [connections.acquire("127.0.0.1", accepted.tcp_port) for _ in range(2)]
        _, count = send_chunks(held, accepted.tcp_ticket,
                               [_wire(c) for c in chunks] + list(extra_frames))
        for connection in held:
            connections.release(connection)
        return count

    sent = await asyncio.to_thread(send)
    for chunk in on_stream:
        await call.write(_wire(chunk))
    if isinstance(trailer, TrailerPart):
        trailer = TrailerPart(trailer.checksums, trailer.first_token,
                              tcp_chunks=sent if tcp_chunks is None else tcp_chunks)
    await call.write(_wire(trailer))
    await call.done_writing()
    return (await read_reply(call, "ack")).ack


def test_a_handoff_over_tcp_decodes_and_returns_its_room(tiny):
    async def scenario():
        async with DecodeHarness(tiny) as h:
            connections = TcpConnections(None)
            before = await h.free()
            stream = h.stub.Stream(decode_pb2.StreamRequest(handoff_id=77), timeout=30)
            payload = h.payload(max_new_tokens=6)
            ack = await send_over_tcp(h, list(split_payload(payload, chunk_bytes=700)),
                                      connections)
            assert ack.bytes_received == sum(t.numel() * t.element_size()
                                             for t in payload.fields.values())
            tokens = [t async for event in stream for t in event.token_ids]
            assert tokens[0] == 5 and len(tokens) == 6
            # the same connections carry the next handoff
            await send_over_tcp(h, list(split_payload(h.payload(handoff_id=78))), connections)
            await h.stub.Abort(types_pb2.AbortRequest(handoff_id=78), timeout=5)
            assert await h.free() == before
            await buffers_back(h)
            connections.close()
    run(scenario())


@pytest.mark.parametrize("kind", TCP_KINDS)
def test_a_bad_chunk_over_tcp_gets_the_streams_status_and_frees_everything(tiny, kind):
    async def scenario():
        async with DecodeHarness(tiny) as h:
            connections = TcpConnections(None)
            before = await h.free()
            parts = mutate(list(split_payload(h.payload(), chunk_bytes=700)), kind)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await send_over_tcp(h, parts, connections)
            assert err.value.code() == EXPECTED[kind], err.value.details()
            assert await h.free() == before
            await buffers_back(h)
            # connections and worker both take the next handoff
            await send_over_tcp(h, list(split_payload(h.payload(handoff_id=78, max_new_tokens=1))),
                                connections)
            connections.close()
    run(scenario())


@pytest.mark.parametrize("case,code", [
    ("not_a_chunk", grpc.StatusCode.INVALID_ARGUMENT),
    ("both_ways", grpc.StatusCode.INVALID_ARGUMENT),
    ("too_few_frames", grpc.StatusCode.DEADLINE_EXCEEDED),
])
def test_frames_that_break_the_rules_are_refused(tiny, case, code):
    async def scenario():
        async with DecodeHarness(tiny, idle_timeout_s=1.0) as h:
            connections = TcpConnections(None)
            before = await h.free()
            header, *chunks, trailer = split_payload(h.payload(), chunk_bytes=700)
            kwargs = {}
            if case == "not_a_chunk":  # a whole trailer where a chunk belongs
                kwargs["extra_frames"] = [_wire(trailer)]
            elif case == "both_ways":
                kwargs["on_stream"] = [chunks.pop()]
            else:  # the trailer counts one more frame than ever comes
                kwargs["tcp_chunks"] = len(chunks) + 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await send_over_tcp(h, [header, *chunks, trailer], connections, **kwargs)
            assert err.value.code() == code, err.value.details()
            assert await h.free() == before
            await buffers_back(h)
            connections.close()
    run(scenario())


def test_a_connection_that_breaks_inside_a_frame_is_data_loss(tiny):
    async def scenario():
        async with DecodeHarness(tiny) as h:
            before = await h.free()
            header, *chunks, trailer = split_payload(h.payload(), chunk_bytes=700)
            call, accepted = await _opened(h, header)

            def half_a_frame() -> None:
                sock = _raw_connection(accepted.tcp_port)
                body = _wire(chunks[0])
                sock.sendall(frame_header(accepted.tcp_ticket, len(body)) + body[:len(body) // 2])
                sock.close()

            await asyncio.to_thread(half_a_frame)
            await call.write(_wire(TrailerPart(trailer.checksums, trailer.first_token,
                                               tcp_chunks=len(chunks))))
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_reply(call, "ack")
            assert err.value.code() == grpc.StatusCode.DATA_LOSS, err.value.details()
            assert "connection" in err.value.details()
            assert await h.free() == before
            await buffers_back(h)
    run(scenario())


def test_frames_for_a_handoff_nobody_holds_are_dropped(tiny):
    """A frame whose handoff ended (or a made-up ticket) is read and thrown away: the
    connection carries the next handoff as before."""
    async def scenario():
        async with DecodeHarness(tiny) as h:
            connections = TcpConnections(None)
            before = await h.free()
            header, *chunks, trailer = split_payload(h.payload(), chunk_bytes=700)
            call, accepted = await _opened(h, header)
            port = accepted.tcp_port
            call.cancel()
            connection = await asyncio.to_thread(connections.acquire, "127.0.0.1", port)
            for chunk in chunks:
                connection.submit(secrets.token_bytes(16), _wire(chunk))
            await asyncio.to_thread(connection.flush)
            connections.release(connection)
            for _ in range(100):
                if await h.free() == before:
                    break
                await asyncio.sleep(0.02)
            assert await h.free() == before
            await send_over_tcp(h, list(split_payload(h.payload(handoff_id=78, max_new_tokens=1))),
                                connections)
            await buffers_back(h)
            connections.close()
    run(scenario())


def test_a_quiet_stream_whose_chunks_come_over_tcp_is_not_idle(tiny):
    """The stream carries nothing between the acceptance and the trailer while the chunks come
    over TCP, for longer than the idle timeout: the handoff is live, not idle."""
    async def scenario():
        async with DecodeHarness(tiny, idle_timeout_s=1.0) as h:
            connections = TcpConnections(None)
            before = await h.free()
            header, *chunks, trailer = split_payload(h.payload(max_new_tokens=1), chunk_bytes=700)
            call, accepted = await _opened(h, header)
            connection = await asyncio.to_thread(connections.acquire, "127.0.0.1",
                                                 accepted.tcp_port)
            for chunk in chunks[:4]:  # 4 x 0.4 s: more than the idle timeout in all
                connection.submit(accepted.tcp_ticket, _wire(chunk))
                await asyncio.sleep(0.4)
            for chunk in chunks[4:]:
                connection.submit(accepted.tcp_ticket, _wire(chunk))
            await asyncio.to_thread(connection.flush)
            await call.write(_wire(TrailerPart(trailer.checksums, trailer.first_token,
                                               tcp_chunks=len(chunks))))
            await call.done_writing()
            await read_reply(call, "ack")
            for _ in range(100):
                if await h.free() == before:
                    break
                await asyncio.sleep(0.02)
            assert await h.free() == before
            connections.close()
    run(scenario())


def test_a_handoff_aborted_with_frames_queued_gives_every_buffer_back(tiny, monkeypatch):
    """Landings held up: frames wait in the inbox and in the landings, each in its buffer.
    Aborted then, the queued frames' buffers come back at once, the landing ones' once their
    landing ends."""
    gate = threading.Event()
    land = chunk_landings._land

    def held_land(*args):
        gate.wait(10)
        return land(*args)

    monkeypatch.setattr(chunk_landings, "_land", held_land)

    async def scenario():
        async with DecodeHarness(tiny) as h:
            pool = h.service.tcp.buffers
            before = await h.free()
            header, *chunks, trailer = split_payload(h.payload(), chunk_bytes=700)
            call, accepted = await _opened(h, header)

            def send() -> None:
                sock = _raw_connection(accepted.tcp_port)
                for chunk in chunks:
                    body = _wire(chunk)
                    sock.sendall(frame_header(accepted.tcp_ticket, len(body)) + body)
                sock.close()

            await asyncio.to_thread(send)
            # 4 landing (ChunkLandings' bound) and 8 waiting (the listener's max_ahead)
            for _ in range(250):
                if pool.num_buffers == 12:
                    break
                await asyncio.sleep(0.02)
            assert pool.num_buffers == 12
            await h.stub.Abort(types_pb2.AbortRequest(handoff_id=77), timeout=5)
            await call.write(_wire(TrailerPart(trailer.checksums, trailer.first_token,
                                               tcp_chunks=len(chunks))))
            await call.done_writing()
            for _ in range(250):  # the queued frames are dropped, the landing ones held
                if pool.num_buffers == 4:
                    break
                await asyncio.sleep(0.02)
            assert pool.num_buffers == 4
            gate.set()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_reply(call, "ack")
            assert err.value.code() == grpc.StatusCode.ABORTED, err.value.details()
            assert await h.free() == before
            await buffers_back(h)
    try:
        run(scenario())
    finally:
        gate.set()
