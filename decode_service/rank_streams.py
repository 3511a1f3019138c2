"""Rank 0's side of per-rank handoff streams on a decode worker: what the servicer asks of the
ranks for one handoff, between the header it accepts and the acknowledgement it sends.

At the header the engine thread has reserved the room and told every rank (its own band
receiver, and the followers by broadcast) to take the handoff's ticket; :meth:`ready` waits
until each follower says it does, so that no frame of a prefill rank can reach a listener
before its inbox exists. At the trailer :meth:`verify` has every rank report what landed
(the followers through the group's store) and compares each band's CRC-32C with the
trailer's: a refusal names the decode rank and keeps the status of docs/protocol.md.
:func:`open_rank_streams` sets it up when the worker starts.
"""

from __future__ import annotations

import asyncio
import secrets
from concurrent.futures import ThreadPoolExecutor

from common.config import ModelConfig
from common.handoff.errors import HandoffError
from common.handoff.parts import TrailerPart
from common.handoff.tcp_frames import TICKET_BYTES
from common.parallel.band_messages import landed_key, ready_key, take_reports, wait_for
from common.parallel.rank_streams import bands_to, transfers
from common.parallel.shard_plan import ShardingError
from decode_service.band_receiver import BandReceiver, BandsLanded
from decode_service.tcp_listener import TcpHandoffListener


class DecodeRankStreams:
    """Per-rank streams of a decode worker of ``world_size`` ranks: rank 0's ``receiver``,
    every rank's listener ``ports`` (index = rank) and the group's ``store``."""

    def __init__(self, receiver: BandReceiver, ports: tuple[int, ...], store,
                 config: ModelConfig) -> None:
        self.receiver = receiver
        self.ports = tuple(ports)
        self.world_size = len(self.ports)
        self.store = store
        self.config = config
        # waits on the store and on rank 0's inboxes: never the writer threads' pool
        self._waits = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rank-streams")

    def takes(self, src_tp: int) -> bool:
        """Whether a header offering per-rank streams from ``src_tp`` ranks takes them: they
        pay only where a side is sharded. INVALID_ARGUMENT for a size that cannot split the
        heads."""
        if src_tp < 1 or (src_tp == 1 and self.world_size == 1):
            return False
        try:
            transfers(self.config, src_tp, self.world_size)
        except ShardingError as exc:
            raise HandoffError("INVALID_ARGUMENT", f"rank_streams {src_tp}: {exc}") from None
        return True

    @staticmethod
    def new_ticket() -> bytes:
        return secrets.token_bytes(TICKET_BYTES)

    def band_names(self, src_tp: int) -> set[str]:
        """Every band the decode ranks receive from ``src_tp`` prefill ranks, by wire name:
        the trailer's checksums of them."""
        return {band.name for dst in range(self.world_size)
                for band in bands_to(self.config, src_tp, self.world_size, dst)}

    async def ready(self, ticket: bytes, timeout_s: float) -> None:
        """Until every follower takes ``ticket``'s frames."""
        keys = [ready_key(ticket, r) for r in range(1, self.world_size)]
        if keys:
            await self._off_loop(take_reports_raw, self.store, keys, timeout_s)

    async def verify(self, ticket: bytes, src_tp: int, trailer: TrailerPart,
                     complete_followers, idle_timeout_s: float) -> int:
        """Every rank's landing checked against ``trailer``; the bytes that landed. Raises
        the refusal of the first rank that has one. ``complete_followers(frames)`` tells the
        followers how many frames were sent to each."""
        frames = tuple(trailer.rank_chunks)
        if len(frames) != self.world_size:
            raise HandoffError("INVALID_ARGUMENT", f"the trailer counts frames for "
                               f"{len(frames)} decode ranks, this worker has "
                               f"{self.world_size}")
        if self.world_size > 1:
            await complete_followers(frames)
        reports = [await self._off_loop(self.receiver.complete, ticket, frames[0],
                                        idle_timeout_s)]
        keys = [landed_key(ticket, r) for r in range(1, self.world_size)]
        if keys:
            try:
                reports += await self._off_loop(take_reports, self.store, keys,
                                                idle_timeout_s + 10.0)
            except TimeoutError:
                raise HandoffError("DEADLINE_EXCEEDED", "a decode rank did not report its "
                                   f"landing in {idle_timeout_s} s") from None
        for rank, report in enumerate(reports):
            self._check(rank, report, src_tp, trailer)
        return sum(report.nbytes for report in reports)

    def _check(self, rank: int, report: BandsLanded, src_tp: int, trailer: TrailerPart) -> None:
        report.raise_error(rank)
        for band in bands_to(self.config, src_tp, self.world_size, rank):
            got, said = report.checksums.get(band.name), trailer.checksums.get(band.name)
            if got != said:
                raise HandoffError("DATA_LOSS", f"decode rank {rank}: band {band.name}: "
                                   f"crc32c {got:#010x} of the bytes received, trailer says "
                                   f"{said:#010x}" if got is not None and said is not None
                                   else f"decode rank {rank}: band {band.name} unchecked")

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._waits, fn, *args)

    def close(self) -> None:
        self._waits.shutdown(wait=False, cancel_futures=True)


def take_reports_raw(store, keys: list[str], timeout_s: float) -> None:
    """Wait for ``keys`` and delete them (their values say nothing more). On a timeout none
    is deleted: the room is given back, and each follower deletes its own then."""
    try:
        wait_for(store, keys, timeout_s)
    except TimeoutError:
        raise HandoffError("DEADLINE_EXCEEDED", f"a decode rank did not take the handoff in "
                           f"{timeout_s} s") from None
    for key in keys:
        store.delete_key(key)


def open_rank_streams(llm, tcp: TcpHandoffListener, host: str,
                      token: str | None) -> DecodeRankStreams:
    """A decode worker's per-rank streams at start-up: rank 0's receiver over the worker's
    listener ``tcp`` in engine ``llm``'s pools, and a listener on every follower (they open
    theirs now, before the engine thread starts broadcasting), checking ``token``."""
    receiver = BandReceiver(tcp, llm.model.config, 0, llm.model.tp.world_size, llm.kv_pool.kv,
                            llm.state_pool.conv, llm.state_pool.ssm)
    followers = llm.runner.followers
    ports = [tcp.port]
    if followers is not None:
        ports += followers.open_band_listeners(host, token)[1:]
    return DecodeRankStreams(receiver, tuple(ports), llm.model.tp.store, llm.model.config)
