"""A prefill worker's side of its send process (``prefill_service/send_process.py``).

:class:`SendProcess` starts the process with a socket pair and a shared memory file of
``slots`` slots; :meth:`SendProcess.call` opens a stream-stream call there and returns a
:class:`ProcessCall`, which a :class:`~prefill_service.handoff_stream.HandoffStream` uses as it
would a ``grpc.aio`` call (``write``, ``read``, ``done_writing``, ``code``, ``details``,
``cancel``). Its ``encode_chunk`` (on a sender thread) writes a chunk message straight into a
free slot, with the GIL released, and ``write_chunks`` (on that thread) then sends only the
slot's number: no chunk byte is copied by gRPC in this process.

A slot is taken by the thread that fills it and given back by the send process once it has
copied the bytes out (or by the call, for a slot filled but never written). If the process
dies, every call open on it ends with UNAVAILABLE (the receivers see their calls reset and free
their reservations) and the next call starts a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import numpy as np

from common.channels import ChannelSecurity
from common.handoff.chunk_codec import encode_chunk_into
from common.lifecycle import PARENT_PID_ENV
from prefill_service.send_wire import Wire, WireClosed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendProcessConfig:
    """``slot_bytes``: the largest message a slot holds (a chunk and its prefix); ``slots``:
    how many messages may be encoded and not yet copied out by the send process."""

    slot_bytes: int
    slots: int = 8

    def __post_init__(self) -> None:
        if self.slot_bytes < 1 or self.slots < 1:
            raise ValueError(f"slot_bytes and slots must be >= 1, got {self.slot_bytes}, "
                             f"{self.slots}")


class SlotPool:
    """The free slots of one process's shared memory; thread-safe."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count))
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, stop: threading.Event) -> int | None:
        """A free slot, waiting for one; None once ``stop`` is set or the pool is closed."""
        with self._cond:
            while not self._free:
                if stop.is_set() or self._closed:
                    return None
                self._cond.wait(timeout=0.05)
            if stop.is_set() or self._closed:
                return None
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)


@dataclass(frozen=True)
class SlotMessage:
    """An encoded message waiting in a slot."""

    slot: int
    nbytes: int


class ProcessCall:
    """A call the send process makes for this worker, with a ``grpc.aio`` call's methods."""

    def __init__(self, child: _Child, call_id: int, deserialize) -> None:
        self._child, self._id, self._deserialize = child, call_id, deserialize
        self._loop = asyncio.get_running_loop()
        self._replies: asyncio.Queue = asyncio.Queue()
        self._status: asyncio.Future = self._loop.create_future()
        self._closed = threading.Event()  # no slot is filled for it any more
        self._lock = threading.Lock()
        self._unsent: set[int] = set()  # slots filled and not yet written

    # --- on a sender thread
    def encode_chunk(self, field: str, layer: int, offset: int, data) -> SlotMessage:
        """``chunk_codec.encode_chunk`` into a free slot (waiting for one)."""
        slot = self._child.slots.acquire(self._closed)
        if slot is None:
            raise self._ended_error()
        try:
            nbytes = encode_chunk_into(self._child.slot_view(slot), field, layer, offset, data)
        except BaseException:
            self._child.slots.release(slot)
            raise
        with self._lock:
            if self._closed.is_set():  # ended while this slot was filled
                self._child.slots.release(slot)
                raise self._ended_error()
            self._unsent.add(slot)
        return SlotMessage(slot, nbytes)

    def write_chunks(self, messages: Iterable[SlotMessage]) -> int:
        """Write each of ``messages`` (made by :meth:`encode_chunk`) as it comes, in order;
        returns their bytes. Raises the call's error once it has ended (a cancelled call ends
        here at the next message)."""
        sent = 0
        for message in messages:
            with self._lock:
                if message.slot not in self._unsent:
                    raise self._ended_error()
                self._unsent.discard(message.slot)
            try:
                self._child.wire.send("slot", self._id, message.slot, message.nbytes)
            except WireClosed:
                self._loop.call_soon_threadsafe(self._child.died)
                raise _rpc_error(grpc.StatusCode.UNAVAILABLE,
                                 "the handoff send process exited") from None
            sent += message.nbytes
        return sent

    # --- on the event loop
    async def write(self, message: bytes) -> None:
        """Write a message that is not a chunk (a header, a trailer, pool copies) as bytes."""
        if self._closed.is_set():
            raise self._ended_error()
        self._send("write", self._id, bytes(message))

    async def done_writing(self) -> None:
        if not self._closed.is_set():
            self._send("done", self._id)

    async def read(self):
        item = await self._replies.get()
        if isinstance(item, bytes):
            return self._deserialize(item)
        self._replies.put_nowait(item)  # the end: every later read sees it too
        if item[0] == grpc.StatusCode.OK:
            return grpc.aio.EOF
        raise _rpc_error(*item)

    async def code(self) -> grpc.StatusCode:
        return (await asyncio.shield(self._status))[0]

    async def details(self) -> str:
        return (await asyncio.shield(self._status))[1]

    def done(self) -> bool:
        return self._status.done()

    def cancel(self) -> bool:
        if self._status.done():
            return False
        try:
            self._send("cancel", self._id)
        except grpc.aio.AioRpcError:
            pass  # the process is gone: so is the call
        self._end(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        return True

    def _send(self, *message) -> None:
        try:
            self._child.wire.send(*message)
        except WireClosed:
            self._child.died()
            raise self._ended_error() from None

    # --- from the send process (on the loop)
    def _on_reply(self, message: bytes) -> None:
        if not self._status.done():
            self._replies.put_nowait(message)

    def _end(self, code: grpc.StatusCode, details: str) -> None:
        self._close()
        if not self._status.done():
            self._status.set_result((code, details))
            self._replies.put_nowait((code, details))

    def _close(self) -> None:
        """Thread-safe: no slot is filled or written for this call any more."""
        with self._lock:
            self._closed.set()
            unsent, self._unsent = self._unsent, set()
        for slot in unsent:
            self._child.slots.release(slot)

    def _ended_error(self) -> Exception:
        if self._status.done():
            code, details = self._status.result()
            if code != grpc.StatusCode.OK:
                return _rpc_error(code, details)
        return _rpc_error(grpc.StatusCode.CANCELLED, "the handoff call was closed")


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Child:
    """One send process: its socket, its shared slots, the calls open on it."""

    def __init__(self, config: SendProcessConfig, security: ChannelSecurity,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.config, self._loop = config, loop
        size = config.slot_bytes * config.slots
        memfd = os.memfd_create("flashsplit-send-slots")
        ours, theirs = socket.socketpair()
        try:
            os.ftruncate(memfd, size)
            self._memory = mmap.mmap(memfd, size)
            self._array = np.frombuffer(self._memory, dtype=np.uint8)
            env = dict(os.environ, **{PARENT_PID_ENV: str(os.getpid())})
            self.process = subprocess.Popen(
                [sys.executable, "-m", "prefill_service.send_process",
                 "--fd", str(theirs.fileno()), "--memfd", str(memfd),
                 "--slot-bytes", str(config.slot_bytes), "--slots", str(config.slots),
                 "--log-level", logging.getLevelName(logging.getLogger().level)],
                pass_fds=(theirs.fileno(), memfd), env=env)
        finally:
            theirs.close()
            os.close(memfd)
        self.wire = Wire(ours)
        self.slots = SlotPool(config.slots)
        self.calls: dict[int, ProcessCall] = {}
        self.alive = True
        tls = security.tls
        self.wire.send("security", None if tls is None
                       else [tls.cert_chain, tls.private_key, tls.root_ca],
                       [list(pair) for pair in security.metadata])
        threading.Thread(target=self._receive, name="send-process-replies", daemon=True).start()

    def slot_view(self, slot: int) -> np.ndarray:
        size = self.config.slot_bytes
        return self._array[slot * size:(slot + 1) * size]

    def _receive(self) -> None:
        try:
            while True:
                message = self.wire.receive()
                kind = message[0]
                if kind == "free":
                    self.slots.release(message[1])
                elif kind == "reply":
                    self._loop.call_soon_threadsafe(self._reply, message[1], message[2])
                elif kind == "end":
                    self._loop.call_soon_threadsafe(self._ended, message[1],
                                                    _CODES.get(message[2],
                                                               grpc.StatusCode.UNKNOWN),
                                                    message[3])
        except WireClosed:
            pass
        except RuntimeError:  # the loop is closed: the worker is shutting down
            return
        except Exception:  # an unreadable message: treat the process as gone
            log.exception("reading the handoff send process's messages failed")
        try:
            self._loop.call_soon_threadsafe(self.died)
        except RuntimeError:
            pass

    def _reply(self, call_id: int, message: bytes) -> None:
        call = self.calls.get(call_id)
        if call is not None:
            call._on_reply(message)

    def _ended(self, call_id: int, code: grpc.StatusCode, details: str) -> None:
        call = self.calls.pop(call_id, None)
        if call is not None:
            call._end(code, details)

    def died(self) -> None:
        """The process is gone (or its socket broke): every open call ends UNAVAILABLE."""
        if not self.alive:
            return
        self.alive = False
        code = self.process.poll()  # None while it is still on its way out
        log.error("the handoff send process (pid %d) exited (code %s); its %d open handoffs "
                  "fail, the next one starts a new process", self.process.pid, code,
                  len(self.calls))
        self.slots.close()
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call._end(grpc.StatusCode.UNAVAILABLE,
                      f"the handoff send process exited (code {code})")
        self.wire.close()
        if code is None:  # reaped once it is gone, or it would stay a zombie
            threading.Thread(target=self._reap, name="send-process-reaper", daemon=True).start()

    def _reap(self) -> None:
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # its socket broke, yet it lives: end it
            self.process.kill()
            self.process.wait()

    def close(self, timeout_s: float = 5.0) -> None:
        self.alive = False
        self.slots.close()
        self.wire.close()  # the process cancels what is open and exits
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class SendProcess:
    """The worker's send process, started at once and again after it dies."""

    def __init__(self, config: SendProcessConfig,
                 security: ChannelSecurity = ChannelSecurity(),
                 on_start: Callable[[], None] = lambda: None) -> None:
        """``on_start`` is called at each start (a metric)."""
        self.config, self.security, self._on_start = config, security, on_start
        self._ids = itertools.count(1)
        self._child: _Child | None = None
        self.starts = 0

    def call(self, address: str, method: str, timeout_s: float, deserialize) -> ProcessCall:
        """A stream-stream call to ``method`` at ``address``, made by the send process
        (started here when none is running); on the event loop."""
        self.start()
        child = self._child
        call_id = next(self._ids)
        call = ProcessCall(child, call_id, deserialize)
        child.calls[call_id] = call
        call._send("open", call_id, address, method, timeout_s)
        return call

    @property
    def pid(self) -> int | None:
        """The running process's id (None before the first call or after it died)."""
        child = self._child
        return child.process.pid if child is not None and child.alive else None

    @property
    def free_slots(self) -> int:
        return self._child.slots.free if self._child is not None else self.config.slots

    def start(self) -> None:
        """Starts the process now (on the event loop), so the first handoff does not wait."""
        if self._child is None or not self._child.alive:
            self._child = _Child(self.config, self.security, asyncio.get_running_loop())
            self.starts += 1
            self._on_start()

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None
