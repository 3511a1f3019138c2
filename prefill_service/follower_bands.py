"""A prefill follower's per-rank handoff streams: what it does with rank 0's
:class:`~common.parallel.band_messages.SendBands` and ``DropBands``.

Each ``SendBands`` queues this rank's bands of what a step made final on its own
:class:`~prefill_service.band_sender.BandSender`; after the final one (the GDN state is in
it) the rank reports what it sent under ``sent_key`` once all of it is written, and rank 0
reads and deletes that report for the trailer. ``DropBands`` comes when the request ends,
however it ended: the sender stops and forgets it, and a report rank 0 never read (it gave up
first, or the handoff failed after the final part) is deleted, or is not set at all if it
was still being written. So no key of a handoff stays in the group's store.

``prefill_service/__main__.py`` hands :class:`PrefillFollowerBands` to the group it starts;
each follower makes one.
"""

from __future__ import annotations

from common.handoff.tcp_tls import client_context
from common.parallel.band_messages import DropBands, DueReports, SendBands, sent_key
from common.tls import TlsFiles
from prefill_service.band_sender import BandSender, BandsSent


class PrefillFollowerBands:
    """Follower ``tp.rank``'s band sender, made on first use from ``follower``'s model and
    pools; implements :class:`~common.parallel.band_messages.BandHandler`. ``tls``: the
    worker's TLS material, for TLS on its connections (None: plaintext); pass it with
    ``functools.partial``, as the group starts each follower with ``(tp, follower)``."""

    def __init__(self, tp, follower, tls: TlsFiles | None = None) -> None:
        self.tp = tp
        self._follower = follower
        self._tls = tls
        self._sender: BandSender | None = None
        # a handoff's report is due from its final part until it is dropped
        self._reports = DueReports(tp.store)

    def handle(self, message) -> None:
        if isinstance(message, SendBands):
            self._send(message)
        elif isinstance(message, DropBands):
            self._drop(message.handoff_id)
        else:
            raise TypeError(f"a prefill follower takes no {type(message).__name__}")

    def _send(self, message: SendBands) -> None:
        if self._sender is None:
            f = self._follower
            self._sender = BandSender(f.model.config, self.tp.rank, f.kv_pool.kv,
                                      f.state_pool.conv, f.state_pool.ssm,
                                      ssl_context=None if self._tls is None
                                      else client_context(self._tls))
        self._sender.send(message.handoff_id, message.plan, message.page_ids, message.start,
                          message.slot)
        if message.slot is not None:  # the last part: report once all of it is written
            key = sent_key(message.handoff_id, self.tp.rank)
            self._reports.expect(key)
            self._sender.finish(message.handoff_id).add_done_callback(
                lambda done: self._reports.report(key, _sent(done)))

    def _drop(self, handoff_id: int) -> None:
        if self._sender is not None:
            self._sender.drop(handoff_id)
        # rank 0 reads the report on success; on any other end it may still be there
        self._reports.cancel(sent_key(handoff_id, self.tp.rank))

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()


def _sent(done) -> BandsSent:
    try:
        return done.result()
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which fails the handoff
        return BandsSent((), {}, 0, f"{type(exc).__name__}: {exc}")
