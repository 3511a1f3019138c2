"""Per-rank handoff streams on the followers: the messages rank 0 broadcasts about them, what
a follower does with each, and the reports that come back to rank 0 through the group's store.

The broadcasts keep their order with the forwards (rank 0 sends them from its engine thread,
between steps), which is what makes the pages safe: a follower hears that a handoff's pages
were freed before it runs any forward that reuses them. The bytes and the reports do not go
through the collectives: a follower's band sender and receiver run on threads of their own,
and what they report (a listener's port, "ready", what was sent, what landed) is set in the
store under a key rank 0 waits for from a thread of its own, out of step with the group.

Prefill: :class:`SendBands` (a step made pages, or the GDN state, final: send this rank's
bands of them; after the final one, report what was sent) and :class:`DropBands`. Decode:
:class:`OpenBandListener` (at start-up), :class:`ExpectBands` (room was reserved: take this
ticket's frames into these pages), :class:`CompleteBands` (the trailer came: report what
landed once this many frames did) and :class:`ForgetBands` (the room is given back).
"""

from __future__ import annotations

import datetime
import pickle
import threading
from dataclasses import dataclass

from common.parallel.rank_streams import RankStreamPlan

PREFIX = "bands/"


@dataclass(frozen=True)
class SendBands:
    handoff_id: int
    plan: RankStreamPlan
    page_ids: list[int]  # the prompt's pages ``start`` on that the step made final
    start: int
    slot: int | None  # the GDN state is final too (the prompt's last chunk)


@dataclass(frozen=True)
class DropBands:
    handoff_id: int


@dataclass(frozen=True)
class OpenBandListener:
    host: str
    token: str | None  # what the listener's hello must carry (None: a cluster without one)


@dataclass(frozen=True)
class ExpectBands:
    ticket: bytes
    page_ids: list[int]
    slot: int
    prompt_len: int
    page_size: int
    src_tp: int


@dataclass(frozen=True)
class CompleteBands:
    ticket: bytes
    frames: tuple[int, ...]  # per decode rank, from the trailer
    idle_timeout_s: float


@dataclass(frozen=True)
class ForgetBands:
    ticket: bytes


BAND_MESSAGES = (SendBands, DropBands, OpenBandListener, ExpectBands, CompleteBands,
                 ForgetBands)


def port_key(rank: int) -> str:
    return f"{PREFIX}port/{rank}"


def ready_key(ticket: bytes, rank: int) -> str:
    return f"{PREFIX}ready/{ticket.hex()}/{rank}"


def landed_key(ticket: bytes, rank: int) -> str:
    return f"{PREFIX}landed/{ticket.hex()}/{rank}"


def sent_key(handoff_id: int, rank: int) -> str:
    return f"{PREFIX}sent/{handoff_id:016x}/{rank}"


def take_reports(store, keys: list[str], timeout_s: float) -> list:
    """The objects set under ``keys`` (blocking, on a thread of the caller's: never the
    engine thread nor an event loop), deleted once read; TimeoutError after ``timeout_s``."""
    if keys:
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # the store says a wait timed out with a RuntimeError
            raise TimeoutError(f"no report under {keys} in {timeout_s} s: {exc}") from None
    out = [pickle.loads(store.get(key)) for key in keys]
    for key in keys:
        store.delete_key(key)
    return out


class FollowerBands:
    """A follower's band sender (prefill) or receiver (decode), made on first use."""

    def __init__(self, tp, follower) -> None:
        self.tp = tp
        self._follower = follower  # its model and pools
        self._sender = None
        self._receiver = None

    def handle(self, message) -> None:
        if isinstance(message, SendBands):
            self._send(message)
        elif isinstance(message, DropBands):
            if self._sender is not None:
                self._sender.drop(message.handoff_id)
        elif isinstance(message, OpenBandListener):
            self._open(message)
        elif isinstance(message, ExpectBands):
            self._receiver.expect(message.ticket, message.page_ids, message.slot,
                                  message.prompt_len, message.page_size, message.src_tp)
            self.tp.store.set(ready_key(message.ticket, self.tp.rank), b"1")
        elif isinstance(message, CompleteBands):
            threading.Thread(target=self._complete, args=(message,), daemon=True,
                             name="band-complete").start()
        elif isinstance(message, ForgetBands):
            self._receiver.forget(message.ticket)
        else:
            raise TypeError(f"not a band message: {type(message).__name__}")

    def _send(self, message: SendBands) -> None:
        if self._sender is None:
            from prefill_service.band_sender import BandSender

            f = self._follower
            self._sender = BandSender(f.model.config, self.tp.rank, f.kv_pool.kv,
                                      f.state_pool.conv, f.state_pool.ssm)
        self._sender.send(message.handoff_id, message.plan, message.page_ids, message.start,
                          message.slot)
        if message.slot is not None:  # the last part: report once all of it is written
            key = sent_key(message.handoff_id, self.tp.rank)
            self._sender.finish(message.handoff_id).add_done_callback(
                lambda done: self.tp.store.set(key, pickle.dumps(_sent(done))))

    def _open(self, message: OpenBandListener) -> None:
        from common.auth import secrets_match
        from decode_service.band_receiver import BandReceiver
        from decode_service.tcp_listener import TcpHandoffListener

        token = message.token
        f = self._follower
        listener = TcpHandoffListener(
            message.host, 0, lambda given: token is None or secrets_match(given, token),
            pin_memory=f.kv_pool.kv.device.type == "cuda")
        self._receiver = BandReceiver(listener, f.model.config, self.tp.rank,
                                      self.tp.world_size, f.kv_pool.kv, f.state_pool.conv,
                                      f.state_pool.ssm)
        self.tp.store.set(port_key(self.tp.rank), str(listener.port))

    def _complete(self, message: CompleteBands) -> None:
        landed = self._receiver.complete(message.ticket, message.frames[self.tp.rank],
                                         message.idle_timeout_s)
        self.tp.store.set(landed_key(message.ticket, self.tp.rank), pickle.dumps(landed))

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        if self._receiver is not None:
            self._receiver.listener.close()


def _sent(done):
    from prefill_service.band_sender import BandsSent

    try:
        return done.result()
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which fails the handoff
        return BandsSent((), {}, 0, f"{type(exc).__name__}: {exc}")
