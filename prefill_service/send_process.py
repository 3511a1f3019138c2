"""The send process: writes a prefill worker's ``stream`` handoffs on gRPC calls of its own.

grpcio copies every message it sends into its own buffer with the GIL held. In the prefill
worker that copy takes turns for the GIL with the engine thread, whose forward is bound by the
host launching kernels at 2k–8k tokens: a 305 MiB handoff slowed the prefill it streams beside
by 60–75 ms on an H100 (docs/handoff_performance.md, run N). Here the copies hold this process's
GIL instead. The worker encodes each chunk into a shared slot (with its GIL released) and sends
only the slot's number (``prefill_service/send_wire.py``); this process opens the calls, writes
the slots' bytes, relays the receiver's replies and each call's final status, and frees slots.

It exits when the worker closes the socket (or dies): every call still open is cancelled, so
the decode workers free what they reserved. Started by ``prefill_service/process_call.py``::

    python -m prefill_service.send_process --fd N --memfd M --slot-bytes S --slots K
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import mmap
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.channels import ChannelSecurity, make_channel
from common.handoff.chunk_codec import bytes_without_gil
from common.lifecycle import die_with_parent_if_asked
from common.tls import TlsFiles
from prefill_service.send_wire import Wire, WireClosed

log = logging.getLogger("flashsplit.send_process")

_STOP = ("stop",)


class _Call:
    """One stream-stream call: writes in the order the worker sent them, replies relayed as
    they come, and one ``end`` with the call's status."""

    def __init__(self, relay: Relay, call_id: int, call) -> None:
        self.relay, self.call_id, self.call = relay, call_id, call
        self.queue: asyncio.Queue = asyncio.Queue()
        self.writer = asyncio.create_task(self._write())
        self.reader = asyncio.create_task(self._read())

    async def _write(self) -> None:
        try:
            while True:
                item = await self.queue.get()
                kind = item[0]
                if kind == "write":
                    await self.call.write(item[2])
                elif kind == "slot":  # copied out of its slot on a thread: await the bytes
                    await self.call.write(await item[2])
                elif kind == "done":
                    await self.call.done_writing()
                    return
                else:  # stopped: the call ended or was cancelled
                    return
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError,
                grpc.RpcError) as exc:
            log.debug("call %d: write failed: %r", self.call_id, exc)  # its status says why
        except Exception:  # a bad slot: the worker is broken, this call cannot go on
            log.exception("call %d: cancelled", self.call_id)
            self.call.cancel()
        finally:
            self._drain()

    def _drain(self) -> None:
        """Drops the writes that will not be made (their slots are freed once copied out)."""
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item[0] == "slot":
                item[2].add_done_callback(lambda f: f.exception())  # retrieved: not logged

    async def _read(self) -> None:
        try:
            while True:
                reply = await self.call.read()
                if reply is grpc.aio.EOF:
                    break
                self.relay.wire.send("reply", self.call_id, reply)
        except (grpc.aio.AioRpcError, asyncio.CancelledError, grpc.RpcError):
            pass
        except WireClosed:
            return
        code = await self.call.code()
        details = await self.call.details()
        self.queue.put_nowait(_STOP)  # a writer waiting for more has nothing left to do
        await asyncio.gather(self.writer, return_exceptions=True)
        self.relay.ended(self.call_id, code.value[0], details or "")

    def cancel(self) -> None:
        self.call.cancel()
        self.queue.put_nowait(_STOP)


class Relay:
    """The process's event loop side: takes the worker's messages, runs the calls."""

    def __init__(self, wire: Wire, slots: mmap.mmap, slot_bytes: int) -> None:
        self.wire = wire
        self._slots = memoryview(slots)
        self._slot_bytes = slot_bytes
        self._security = ChannelSecurity()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._calls: dict[int, _Call] = {}
        self._stopped: asyncio.Event | None = None
        # slots copied out into ``bytes`` (the GIL released) while the loop writes the last ones
        self._copier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="slot-copy")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()

        def receive() -> None:  # a thread: the socket is blocking
            try:
                while True:
                    message = self.wire.receive()
                    loop.call_soon_threadsafe(self._handle, message)
            except WireClosed:
                pass
            except Exception:  # an unreadable message: the worker is broken, stop
                log.exception("reading the worker's messages failed; stopping")
            loop.call_soon_threadsafe(self._stopped.set)

        threading.Thread(target=receive, name="send-process-wire", daemon=True).start()
        await self._stopped.wait()
        for call in list(self._calls.values()):
            call.cancel()  # the receivers free what they reserved
        await asyncio.gather(*(c.reader for c in list(self._calls.values())),
                             return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
        self._copier.shutdown(wait=True)

    def _handle(self, message: list) -> None:
        kind = message[0]
        if kind == "security":
            tls = None if message[1] is None else TlsFiles(*message[1])
            self._security = ChannelSecurity(tls=tls, metadata=tuple(map(tuple, message[2])))
        elif kind == "open":
            _, call_id, address, method, timeout_s = message
            try:
                call = self._open(address, method, timeout_s)
            except Exception as exc:  # e.g. an address gRPC cannot parse: the call ends here
                self.ended(call_id, grpc.StatusCode.UNAVAILABLE.value[0],
                           f"the send process could not open a call to {address!r}: {exc}")
                return
            self._calls[call_id] = _Call(self, call_id, call)
        elif kind in ("write", "slot", "done", "cancel"):
            call = self._calls.get(message[1])
            if call is None:  # ended already: nothing will be written
                if kind == "slot":
                    self.free(message[2])
            elif kind == "cancel":
                call.cancel()
            elif kind == "slot":
                copied = asyncio.get_running_loop().run_in_executor(
                    self._copier, self.take_slot, message[2], message[3])
                call.queue.put_nowait(("slot", message[1], copied))
            else:
                call.queue.put_nowait(message)
        else:
            log.error("unknown message %r from the worker; stopping", kind)
            self._stopped.set()

    def _open(self, address: str, method: str, timeout_s: float):
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = make_channel(address, self._security)
        return channel.stream_stream(method, request_serializer=None,
                                     response_deserializer=None)(timeout=timeout_s)

    def take_slot(self, slot: int, nbytes: int) -> bytes:
        """The slot's first ``nbytes`` as ``bytes`` (gRPC takes nothing else); the slot is
        free again once they are copied out."""
        start = slot * self._slot_bytes
        if slot < 0 or not 0 <= nbytes <= self._slot_bytes or start + nbytes > len(self._slots):
            raise ValueError(f"slot {slot} with {nbytes} bytes is outside the shared memory")
        try:
            return bytes_without_gil(self._slots[start:start + nbytes])
        finally:
            self.free(slot)

    def free(self, slot: int) -> None:
        try:
            self.wire.send("free", slot)
        except WireClosed:
            pass

    def ended(self, call_id: int, code: int, details: str) -> None:
        self._calls.pop(call_id, None)
        try:
            self.wire.send("end", call_id, code, details)
        except WireClosed:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashsplit-send-process")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the worker")
    parser.add_argument("--memfd", type=int, required=True, help="the shared slots' file")
    parser.add_argument("--slot-bytes", type=int, required=True)
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_parent_if_asked()
    wire = Wire(socket.socket(fileno=args.fd))
    slots = mmap.mmap(args.memfd, args.slot_bytes * args.slots)
    os.close(args.memfd)  # the mapping keeps the memory
    try:
        asyncio.run(Relay(wire, slots, args.slot_bytes).run())
    finally:
        wire.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
