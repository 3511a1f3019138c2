"""Rank 0's part of one handoff's per-rank streams on a prefill worker: everything
:class:`~prefill_service.handoff_stream.HandoffStream` does for them, between the header it
offers them in and the trailer.

- :func:`take_plan`: from the decode worker's ``accepted`` reply (one listener port per
  decode rank and a ticket), the :class:`RankStreamPlan` every prefill rank sends by, or None
  where the handoff goes through this rank instead; refused (:class:`RankStreamsRefused`)
  when the two sizes cannot split the heads alike, or ``--tp-handoff ranks`` demands streams
  the receiver did not offer.
- :meth:`LeaderBands.queue`: this rank's own bands of what a step made final go on its band
  sender, which waits on its own thread for the step that wrote them (the followers are told
  by the engine thread, ``common/parallel/band_messages.py``).
- :meth:`LeaderBands.collect`: at the trailer, what every rank sent (this rank's from its
  sender, the followers' read and deleted from the group's store), merged into the bands'
  checksums and the frames per decode rank that the trailer carries.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from common.handoff.bands import BANDED_FIELDS
from common.handoff.manifest import FieldSpec
from common.handoff.parts import HeaderPart
from common.handoff.tcp_frames import tcp_host
from common.parallel.band_messages import sent_key, take_reports
from common.parallel.rank_streams import RankStreamPlan, transfers
from prefill_service.band_sender import BandSender, BandsSent
from prefill_service.engine import StateReady


@dataclass(frozen=True)
class PrefillRankStreams:
    """A prefill worker's side of per-rank streams: rank 0's own sender, the group's size and
    store (where the followers report what they sent), whether every handoff must take them
    (``--tp-handoff ranks``), and the internal token the decode ranks' listeners check."""

    sender: BandSender
    tp_size: int
    store: object | None
    required: bool
    token: str | None = field(default=None, repr=False)
    report_timeout_s: float = 120.0


class RankStreamsRefused(Exception):
    """This handoff cannot go as the worker's ``--tp-handoff`` says (the message says why)."""


def take_plan(streams: PrefillRankStreams, accepted, address: str,
              header: HeaderPart) -> RankStreamPlan | None:
    """The plan of per-rank streams when the receiver's ``accepted`` listed its ranks' ports,
    else None (the state goes through this rank); RankStreamsRefused when they cannot be
    taken or ``streams.required`` and they were not offered."""
    host = tcp_host(address)
    if accepted.rank_ports and host is not None:
        plan = RankStreamPlan(host, tuple(accepted.rank_ports), accepted.rank_ticket,
                              streams.token, header.prompt_len, header.layout.page_size,
                              streams.tp_size)
        try:  # the receiver's size must split the heads as ours does
            transfers(streams.sender.config, plan.src_tp, plan.dst_tp)
        except ValueError as exc:
            raise RankStreamsRefused(f"the decode worker's {plan.dst_tp} ranks: {exc}") from None
        return plan
    if streams.required:
        raise RankStreamsRefused(
            "the decode worker takes no per-rank streams (--tp-handoff leader, TLS, "
            "--handoff-transport stream, or a worker that predates them): use "
            "--tp-handoff auto or leader")
    return None


def unbanded(manifest: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
    """The fields of ``manifest`` that still go on the call (the draft context)."""
    return {n: s for n, s in manifest.items() if n not in BANDED_FIELDS}


class LeaderBands:
    """Rank 0's bands of handoff ``handoff_id`` under ``plan``; its reads of the store run on
    ``executor`` (never the event loop)."""

    def __init__(self, streams: PrefillRankStreams, plan: RankStreamPlan, handoff_id: int,
                 executor: ThreadPoolExecutor) -> None:
        self.streams = streams
        self.plan = plan
        self.handoff_id = handoff_id
        self._executor = executor
        self._pages_sent = 0
        self._states_sent = False
        self._sends: list = []

    def queue(self, ready: StateReady) -> None:
        """Queue this rank's bands of the pages ``ready`` made final and not yet queued, and
        of the GDN state once it is final, on the band sender."""
        start, end = self._pages_sent, max(self._pages_sent, ready.num_pages)
        states = ready.final_states and not self._states_sent
        if end == start and not states:
            return
        self._pages_sent, self._states_sent = end, self._states_sent or states
        self._sends.append(self.streams.sender.send(
            self.handoff_id, self.plan, ready.page_ids[start:end], start,
            ready.slot if states else None, wait=lambda: _step_over(ready)))

    async def collect(self) -> BandsSent:
        """What every rank sent, once every one has written it all. RuntimeError when a
        rank's stream failed, TimeoutError when a follower did not report in
        ``streams.report_timeout_s``."""
        for sending in self._sends:
            await asyncio.wrap_future(sending)
        reports = [await asyncio.wrap_future(self.streams.sender.finish(self.handoff_id))]
        keys = [sent_key(self.handoff_id, r) for r in range(1, self.streams.tp_size)]
        if keys:
            reports += await asyncio.get_running_loop().run_in_executor(
                self._executor, take_reports, self.streams.store, keys,
                self.streams.report_timeout_s)
        sent = merge_sent(reports)
        if sent.error is not None:
            raise RuntimeError(f"a per-rank stream failed: {sent.error}")
        return sent

    def drop(self) -> None:
        """The handoff ended before (or without) its trailer: this rank sends nothing more
        (a no-op once collected)."""
        self.streams.sender.drop(self.handoff_id)


def merge_sent(reports: list[BandsSent]) -> BandsSent:
    """Every prefill rank's report as one: frames per decode rank summed, checksums joined
    (each band has one sender), the first error."""
    width = max((len(r.frames) for r in reports), default=0)
    frames = [0] * width
    checksums: dict[str, int] = {}
    error = None
    for rank, report in enumerate(reports):
        for dst, count in enumerate(report.frames):
            frames[dst] += count
        checksums.update(report.checksums)
        if report.error is not None and error is None:
            error = f"prefill rank {rank}: {report.error}"
    return BandsSent(tuple(frames), checksums, sum(r.nbytes for r in reports), error)


def _step_over(ready: StateReady) -> None:
    """Block until the step that wrote ``ready``'s state is over (its last layer has run)."""
    progress = ready.layer_ready
    if progress is not None:
        event = progress.wait(progress.num_layers - 1)
        if event is not None:
            event.synchronize()
    elif ready.ready is not None:
        ready.ready.synchronize()
