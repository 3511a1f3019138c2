"""A decode follower's reports of per-rank streams leave no key behind in the group's store:
handoffs that are admitted, whose room is freed after the trailer came (before or after the
follower's landing report is written), whose bands never all come (a timeout), that fail
the checksum check, or whose readiness rank 0 never read all end with only the follower's
port key in a real TCPStore. Rank 0's side is the worker's own (``DecodeRankStreams``, its
receiver), and a prefill worker of one rank sends to both decode ranks over real TCP."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
from types import SimpleNamespace

import pytest

from common.handoff.errors import HandoffError
from common.handoff.parts import TrailerPart
from common.parallel.band_messages import (CompleteBands, ExpectBands, ForgetBands,
                                           OpenBandListener, landed_key, port_key, ready_key,
                                           wait_for)
from common.parallel.rank_streams import RankStreamPlan
from decode_service.follower_bands import DecodeFollowerBands
from decode_service.rank_streams import DecodeRankStreams
from prefill_service.band_sender import BandSender
from tests.common.parallel.band_fixtures import config, listeners, store  # noqa: F401
from tests.decode_service.test_band_receiver import PAGE, PROMPT, full_pools, part, receivers

PAGES, SLOT = [2, 4, 6], 2
IDLE_S = 10.0


class Decode:
    """Ranks 0 and 1 of a decode worker of 2 over ``store``, and a prefill sender of 1 rank."""

    def __init__(self, config, store, listeners) -> None:
        (self.receiver, _), _ = receivers(config, 2, listeners)
        one = part(config, {k: v.clone().zero_() for k, v in full_pools(config).items()}, 1, 2)
        follower = SimpleNamespace(model=SimpleNamespace(config=config),
                                   kv_pool=SimpleNamespace(kv=one["kv"]),
                                   state_pool=SimpleNamespace(conv=one["conv"], ssm=one["ssm"]))
        self.follower = DecodeFollowerBands(SimpleNamespace(rank=1, world_size=2, store=store),
                                            follower)
        self.follower.handle(OpenBandListener("127.0.0.1", None))
        port = int(store.get(port_key(1)))
        self.ranks = DecodeRankStreams(self.receiver, (self.receiver.port, port), store, config)
        full = full_pools(config)
        self.sender = BandSender(config, 0, full["kv"], full["conv"], full["ssm"])

    def reserve(self) -> bytes:
        """What the engine thread does at a header: every rank expects the ticket."""
        ticket = secrets.token_bytes(16)
        self.receiver.expect(ticket, PAGES, SLOT, PROMPT, PAGE, 1)
        self.follower.handle(ExpectBands(ticket, PAGES, SLOT, PROMPT, PAGE, 1))
        return ticket

    def send(self, ticket: bytes, handoff_id: int) -> TrailerPart:
        """The prefill worker's bands, and the trailer that counts them."""
        plan = RankStreamPlan("127.0.0.1", self.ranks.ports, ticket, None, PROMPT, PAGE, 1)
        self.sender.send(handoff_id, plan, [3, 5, 7], 0, 1)
        sent = self.sender.finish(handoff_id).result(timeout=30)
        assert sent.error is None
        return TrailerPart(checksums=dict(sent.checksums), rank_chunks=sent.frames)

    def verify(self, ticket: bytes, trailer: TrailerPart, idle_s: float = IDLE_S) -> int:
        async def complete_followers(frames):
            self.follower.handle(CompleteBands(ticket, frames, idle_s))

        return asyncio.run(self.ranks.verify(ticket, 1, trailer, complete_followers, idle_s))

    def free(self, ticket: bytes) -> None:
        """What the engine thread does when a room is given back."""
        self.receiver.forget(ticket)
        self.follower.handle(ForgetBands(ticket))

    def close(self) -> None:
        self.sender.close()
        self.follower.close()
        self.ranks.close()


def landings_done() -> None:
    """Until every follower thread that waits for a landing has reported (or not)."""
    for thread in threading.enumerate():
        if thread.name == "band-complete":
            thread.join(timeout=30)


def test_no_handoff_leaves_a_key_in_the_store(config, store, listeners):
    decode = Decode(config, store, listeners)
    tickets = []

    def begin(handoff_id: int) -> tuple[bytes, TrailerPart]:
        ticket = decode.reserve()
        tickets.append(ticket)
        asyncio.run(decode.ranks.ready(ticket, IDLE_S))
        return ticket, decode.send(ticket, handoff_id)

    # admitted: rank 0 reads (and deletes) every rank's readiness and landing
    ticket, trailer = begin(1)
    assert decode.verify(ticket, trailer) > 0

    # the room freed after the trailer, the landing report already written
    ticket, trailer = begin(2)
    decode.follower.handle(CompleteBands(ticket, trailer.rank_chunks, IDLE_S))
    wait_for(store, [landed_key(ticket, 1)], 30.0)
    decode.free(ticket)

    # the room freed while the follower may still be waiting for its frames
    ticket, trailer = begin(3)
    decode.follower.handle(CompleteBands(ticket, (trailer.rank_chunks[0],
                                                  trailer.rank_chunks[1] + 1), IDLE_S))
    decode.free(ticket)
    landings_done()

    # timed out: the trailer counts a frame that never comes to rank 1
    ticket, trailer = begin(4)
    short = dataclasses.replace(trailer, rank_chunks=(trailer.rank_chunks[0],
                                                      trailer.rank_chunks[1] + 1))
    with pytest.raises(HandoffError, match="decode rank 1") as refused:
        decode.verify(ticket, short, idle_s=0.3)
    assert refused.value.code == "DEADLINE_EXCEEDED"
    decode.free(ticket)

    # failed: a band's checksum in the trailer is not the bytes' (DATA_LOSS)
    ticket, trailer = begin(5)
    name = next(iter(trailer.checksums))
    bad = dataclasses.replace(trailer, checksums={**trailer.checksums,
                                                  name: trailer.checksums[name] ^ 1})
    with pytest.raises(HandoffError) as refused:
        decode.verify(ticket, bad)
    assert refused.value.code == "DATA_LOSS"
    decode.free(ticket)

    # rank 0 gave up before it read the follower's readiness (or the call was cancelled)
    ticket = decode.reserve()
    tickets.append(ticket)
    wait_for(store, [ready_key(ticket, 1)], 30.0)
    decode.free(ticket)

    landings_done()
    left = [key for ticket in tickets for rank in (0, 1)
            for key in (ready_key(ticket, rank), landed_key(ticket, rank)) if store.check([key])]
    assert left == []
    assert store.num_keys() == 1  # the follower's listener port, set at start-up
    decode.close()
