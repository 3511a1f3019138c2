"""A decode follower's per-rank handoff streams: what it does with rank 0's
:class:`~common.parallel.band_messages.OpenBandListener`, ``ExpectBands``,
``CompleteBands`` and ``ForgetBands``.

At start-up the follower opens a handoff listener of its own and says its port under
``port_key`` (the one key that stays). For each handoff: ``ExpectBands`` opens an inbox on its
:class:`~decode_service.band_receiver.BandReceiver` and says so under ``ready_key``;
``CompleteBands`` waits, on a thread of its own, until the frames the trailer counts landed,
and says what did under ``landed_key``. Rank 0 reads and deletes both. ``ForgetBands`` comes
whenever the handoff's room is given back (it failed, timed out or was cancelled): the inbox
closes, and whichever of its keys rank 0 did not read is deleted, or is not set at all if the
landing was still being waited for. So no key of a handoff stays in the group's store.

``decode_service/__main__.py`` hands :class:`DecodeFollowerBands` to the group it starts; each
follower makes one.
"""

from __future__ import annotations

import threading

from common.auth import secrets_match
from common.handoff.tcp_tls import server_context
from common.parallel.band_messages import (CompleteBands, DueReports, ExpectBands,
                                           ForgetBands, OpenBandListener, landed_key, port_key,
                                           ready_key)
from common.tls import TlsFiles
from decode_service.band_receiver import BandReceiver
from decode_service.tcp_listener import TcpHandoffListener


class DecodeFollowerBands:
    """Follower ``tp.rank``'s band receiver over a listener of its own, on ``follower``'s
    pools; implements :class:`~common.parallel.band_messages.BandHandler`."""

    def __init__(self, tp, follower, tls: TlsFiles | None = None,
                 require_client_cert: bool = False) -> None:
        """``tls`` and ``require_client_cert``: the worker's server TLS, for TLS on this rank's
        listener (None: plaintext); pass them with ``functools.partial``."""
        self.tp = tp
        self._follower = follower
        self._tls, self._require_client_cert = tls, require_client_cert
        self._receiver: BandReceiver | None = None
        # a ticket's landing report is due from CompleteBands until it is forgotten
        self._reports = DueReports(tp.store)

    def handle(self, message) -> None:
        if isinstance(message, OpenBandListener):
            self._open(message)
        elif isinstance(message, ExpectBands):
            self._require_receiver(message)
            self._receiver.expect(message.ticket, message.page_ids, message.slot,
                                  message.prompt_len, message.page_size, message.src_tp)
            self.tp.store.set(ready_key(message.ticket, self.tp.rank), b"1")
        elif isinstance(message, CompleteBands):
            self._require_receiver(message)
            self._reports.expect(landed_key(message.ticket, self.tp.rank))
            threading.Thread(target=self._complete, args=(message,), daemon=True,
                             name="band-complete").start()
        elif isinstance(message, ForgetBands):
            self._forget(message.ticket)
        else:
            raise TypeError(f"a decode follower takes no {type(message).__name__}")

    def _require_receiver(self, message) -> None:
        if self._receiver is None:
            raise RuntimeError(f"{type(message).__name__} before OpenBandListener")

    def _open(self, message: OpenBandListener) -> None:
        token = message.token
        f = self._follower
        listener = TcpHandoffListener(
            message.host, 0, lambda given: token is None or secrets_match(given, token),
            pin_memory=f.kv_pool.kv.device.type == "cuda",
            ssl_context=None if self._tls is None
            else server_context(self._tls, self._require_client_cert))
        self._receiver = BandReceiver(listener, f.model.config, self.tp.rank,
                                      self.tp.world_size, f.kv_pool.kv, f.state_pool.conv,
                                      f.state_pool.ssm)
        self.tp.store.set(port_key(self.tp.rank), str(listener.port))

    def _complete(self, message: CompleteBands) -> None:
        landed = self._receiver.complete(message.ticket, message.frames[self.tp.rank],
                                         message.idle_timeout_s)
        self._reports.report(landed_key(message.ticket, self.tp.rank), landed)

    def _forget(self, ticket: bytes) -> None:
        if self._receiver is not None:
            self._receiver.forget(ticket)
        # rank 0 reads both when the handoff is admitted; on any other end they may stay
        self._reports.cancel(ready_key(ticket, self.tp.rank), landed_key(ticket, self.tp.rank))

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.listener.close()
