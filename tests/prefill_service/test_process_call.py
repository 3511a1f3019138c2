"""The send process against a real gRPC server: writes in order and byte for byte, replies
and statuses relayed, cancellation reaching the receiver, a killed process failing its calls
with UNAVAILABLE and the next call starting a new one, every slot free after each case."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import grpc
import numpy as np
import pytest

from common.channels import ChannelSecurity
from common.handoff.chunk_codec import decode_chunk, encode_chunk
from prefill_service.handoff_sender import uses_send_process
from prefill_service.process_call import SendProcess, SendProcessConfig, SlotMessage

METHOD = "/test.Sink/Stream"
SLOT_BYTES = 4096


class Sink:
    """A stream-stream method that keeps what it is sent; ``behaviour`` says how it answers:
    ``ack`` (b"accepted" after the first message, b"ack" after the last), ``refuse`` (aborts
    with RESOURCE_EXHAUSTED on the first message), ``hold`` (answers nothing)."""

    def __init__(self, behaviour: str = "ack") -> None:
        self.behaviour = behaviour
        self.received: list[bytes] = []
        self.metadata: dict[str, str] = {}
        self.ended = asyncio.Event()
        self.cancelled = False

    async def stream(self, requests, context):
        self.metadata = dict(context.invocation_metadata())
        try:
            async for message in requests:
                self.received.append(message)
                if self.behaviour == "refuse":
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
                if self.behaviour == "ack" and len(self.received) == 1:
                    yield b"accepted"
            if self.behaviour == "ack":
                yield b"ack"
            else:  # until the caller goes away
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.ended.set()


@contextlib.asynccontextmanager
async def serving(sink: Sink):
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler("test.Sink", {
        "Stream": grpc.stream_stream_rpc_method_handler(sink.stream)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def opened(sink: Sink, slots: int = 2, security: ChannelSecurity = ChannelSecurity()):
    """A send process and one call of it to ``sink``, its header written."""
    process = SendProcess(SendProcessConfig(SLOT_BYTES, slots=slots), security)
    try:
        async with serving(sink) as address:
            call = process.call(address, METHOD, 30.0, bytes)
            await call.write(b"header")
            yield process, call
    finally:
        process.close()


def chunk_data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, 1000 + 97 * i, dtype=np.uint8)


async def encode_on_thread(call, i: int) -> SlotMessage:
    return await asyncio.to_thread(call.encode_chunk, "kv", i, 10 * i, chunk_data(i))


async def write_on_thread(call, *messages: SlotMessage) -> int:
    """``write_chunks`` on a thread, as a prefill worker's sender thread calls it."""
    return await asyncio.to_thread(call.write_chunks, messages)


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), 60))


def test_writes_arrive_in_order_and_the_replies_come_back():
    async def scenario():
        sink = Sink()
        security = ChannelSecurity(metadata=(("x-token", "secret"),))
        async with opened(sink, security=security) as (process, call):
            assert await call.read() == b"accepted"
            # more chunks than slots: each waits for one the process has copied out
            for i in range(9):
                await write_on_thread(call, await encode_on_thread(call, i))
            await call.write(b"trailer")
            await call.done_writing()
            assert await call.read() == b"ack"
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            await sink.ended.wait()
            await asyncio.sleep(0.05)  # the last slot's release crosses the socket
            return sink, process.free_slots

    sink, free = run(scenario)
    assert sink.metadata["x-token"] == "secret"
    assert sink.received[0] == b"header" and sink.received[-1] == b"trailer"
    chunks = sink.received[1:-1]
    assert chunks == [encode_chunk("kv", i, 10 * i, chunk_data(i)) for i in range(9)]
    assert decode_chunk(chunks[3]).layer == 3
    assert free == 2


def test_a_refusal_comes_back_as_the_receivers_status():
    async def scenario():
        async with opened(Sink("refuse")) as (process, call):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            # a later chunk is refused with the same status, its slot given back
            with pytest.raises(grpc.aio.AioRpcError) as later:
                await write_on_thread(call, await encode_on_thread(call, 1))
            await asyncio.sleep(0.05)
            return err.value, later.value, await call.code(), process.free_slots

    err, later, code, free = run(scenario)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == "no room"
    assert later.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and free == 2


def test_cancel_reaches_the_receiver_and_gives_back_unwritten_slots():
    async def scenario():
        sink = Sink("hold")
        async with opened(sink, slots=3) as (process, call):
            await write_on_thread(call, await encode_on_thread(call, 1))
            unwritten = await encode_on_thread(call, 2)  # filled, never written
            while len(sink.received) < 2:
                await asyncio.sleep(0.01)
            assert call.cancel()
            await sink.ended.wait()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await write_on_thread(call, unwritten)
            await asyncio.sleep(0.05)
            return sink, err.value, await call.code(), process.free_slots

    sink, err, code, free = run(scenario)
    assert sink.cancelled
    assert err.code() == grpc.StatusCode.CANCELLED and code == grpc.StatusCode.CANCELLED
    assert free == 3


def test_a_killed_process_fails_its_calls_and_the_next_call_starts_another():
    async def scenario():
        sink = Sink("hold")
        async with opened(sink) as (process, call):
            while not sink.received:
                await asyncio.sleep(0.01)
            first_pid = process.pid
            os.kill(first_pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            await sink.ended.wait()  # the receiver saw its call end
            # the next call goes through a new process
            again = Sink()
            async with serving(again) as other:
                call = process.call(other, METHOD, 30.0, bytes)
                await call.write(b"header")
                assert await call.read() == b"accepted"
                await write_on_thread(call, await encode_on_thread(call, 0))
                await call.done_writing()
                assert await call.read() == b"ack"
                await asyncio.sleep(0.05)
                return (err.value, first_pid, process.pid, process.starts,
                        process.free_slots, again.received)

    err, first_pid, pid, starts, free, received = run(scenario)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "send process exited" in err.details()
    assert pid != first_pid and starts == 2 and free == 2
    assert received == [b"header", encode_chunk("kv", 0, 0, chunk_data(0))]


def test_closing_ends_the_process_and_cancels_what_is_open():
    async def scenario():
        sink = Sink("hold")
        async with opened(sink) as (process, call):
            while not sink.received:
                await asyncio.sleep(0.01)
            child = process._child.process
            await asyncio.to_thread(process.close)
            await asyncio.wait_for(sink.ended.wait(), 10)
            return child.returncode, sink.cancelled

    code, cancelled = run(scenario)
    assert code == 0 and cancelled


def test_a_chunk_larger_than_a_slot_is_refused_and_its_slot_given_back():
    async def scenario():
        process = SendProcess(SendProcessConfig(64, slots=1))
        try:
            async with serving(Sink("hold")) as address:
                call = process.call(address, METHOD, 30.0, bytes)
                with pytest.raises(ValueError, match="does not fit"):
                    await encode_on_thread(call, 0)
                call.cancel()
                return process.free_slots
        finally:
            process.close()

    assert run(scenario) == 1


@pytest.mark.parametrize("sender,transport,device,expected", [
    ("auto", "stream", "cuda", True),
    ("auto", "stream", "cuda:1", True),
    ("auto", "stream", "cpu", False),   # the process would take a core from the forward
    ("auto", "tcp", "cuda", False),     # tcp's frames leave through sendall, off the GIL
    ("auto", "auto", "cuda", False),
    ("process", "auto", "cpu", True),
    ("thread", "stream", "cuda", False),
])
def test_which_workers_take_a_send_process(sender, transport, device, expected):
    assert uses_send_process(sender, transport, device) == expected


def test_an_unknown_sender_is_refused():
    with pytest.raises(ValueError, match="unknown handoff sender"):
        uses_send_process("fork", "stream", "cuda")


def test_a_call_to_an_address_grpc_cannot_use_fails_with_its_status():
    async def scenario():
        process = SendProcess(SendProcessConfig(SLOT_BYTES, slots=2))
        try:
            call = process.call("", METHOD, 30.0, bytes)
            await call.write(b"header")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            await asyncio.sleep(0.05)
            return err.value, process.free_slots, process.pid
        finally:
            process.close()

    err, free, pid = run(scenario)
    assert err.code() != grpc.StatusCode.OK and free == 2 and pid is not None  # still serving


def test_a_sender_thread_writes_what_it_encodes_in_order():
    """``write_chunks`` on the thread that encodes: the chunks go out in order without the
    event loop; once the call is cancelled, the thread stops at its next chunk."""
    async def scenario():
        sink = Sink()
        async with opened(sink) as (process, call):
            assert await call.read() == b"accepted"
            made = (call.encode_chunk("kv", i, 10 * i, chunk_data(i)) for i in range(9))
            sent = await asyncio.to_thread(call.write_chunks, made)
            await call.write(b"trailer")
            await call.done_writing()
            assert await call.read() == b"ack"
            await sink.ended.wait()

            held = Sink("hold")
            async with serving(held) as other:
                cancelled = process.call(other, METHOD, 30.0, bytes)
                await cancelled.write(b"header")
                cancelled.cancel()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.to_thread(cancelled.write_chunks, (
                        cancelled.encode_chunk("kv", i, 0, chunk_data(i)) for i in range(3)))
            await asyncio.sleep(0.05)
            return sink.received, sent, err.value, process.free_slots

    received, sent, err, free = run(scenario)
    chunks = [encode_chunk("kv", i, 10 * i, chunk_data(i)) for i in range(9)]
    assert received == [b"header", *chunks, b"trailer"] and sent == sum(map(len, chunks))
    assert err.code() == grpc.StatusCode.CANCELLED and free == 2
