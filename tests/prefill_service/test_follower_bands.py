"""A prefill follower's reports of per-rank streams leave no key behind in the group's store:
handoffs that succeed, are dropped after their final part (before or after the report is
written), fail (a decode rank unreachable) or whose report rank 0 gave up waiting for all end
with no ``bands/`` key of theirs in a real TCPStore, once the engine says the request ended
(``DropBands``, which it says whatever the end). Rank 0's side is the worker's own
(``LeaderBands``), its sender and a follower's over real TCP to a decode rank's receiver."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from common.parallel.band_messages import DropBands, SendBands, sent_key, wait_for
from common.parallel.rank_streams import RankStreamPlan
from prefill_service.band_sender import BandSender
from prefill_service.engine import StateReady
from prefill_service.follower_bands import PrefillFollowerBands
from prefill_service.leader_bands import LeaderBands, PrefillRankStreams
from tests.common.parallel.band_fixtures import config, listeners, store  # noqa: F401
from tests.decode_service.test_band_receiver import PAGE, PROMPT, full_pools, part, receivers
from tests.ports import closed_port

PAGES, SLOT = [3, 5, 7], 1


class Prefill:
    """Ranks 0 and 1 of a prefill worker of 2: rank 0's streams and band sender, rank 1's
    follower handler, over ``store``; sending to one decode rank."""

    def __init__(self, config, store, report_timeout_s: float = 30.0) -> None:
        full = full_pools(config)
        zero, one = part(config, full, 0, 2), part(config, full, 1, 2)
        self.streams = PrefillRankStreams(
            BandSender(config, 0, zero["kv"], zero["conv"], zero["ssm"]), 2, store,
            required=True, report_timeout_s=report_timeout_s)
        follower = SimpleNamespace(model=SimpleNamespace(config=config),
                                   kv_pool=SimpleNamespace(kv=one["kv"]),
                                   state_pool=SimpleNamespace(conv=one["conv"], ssm=one["ssm"]))
        self.follower = PrefillFollowerBands(SimpleNamespace(rank=1, world_size=2, store=store),
                                             follower)
        self.executor = ThreadPoolExecutor(max_workers=2)

    def leader(self, handoff_id: int, plan: RankStreamPlan) -> LeaderBands:
        bands = LeaderBands(self.streams, plan, handoff_id, self.executor)
        bands.queue(StateReady(tuple(PAGES), SLOT, len(PAGES), False, first_token=1))
        return bands

    def send_final(self, handoff_id: int, plan: RankStreamPlan) -> None:
        self.follower.handle(SendBands(handoff_id, plan, PAGES, 0, SLOT))

    def settle(self) -> None:
        """Until the follower's sender has run everything queued, reports included (its
        single thread runs a handoff's report before the next task)."""
        self.follower._sender.finish(-1).result(timeout=30)

    def close(self) -> None:
        self.streams.sender.close()
        self.follower.close()
        self.executor.shutdown()


def collect(bands: LeaderBands):
    return asyncio.run(bands.collect())


def keys_left(store, handoff_ids) -> list[str]:
    keys = [sent_key(hid, rank) for hid in handoff_ids for rank in (0, 1)]
    return [key for key in keys if store.check([key])]


def test_no_handoff_leaves_a_key_in_the_store(config, store, listeners):
    (receiver, _), = receivers(config, 1, listeners)
    prefill = Prefill(config, store)

    def plan(port=None):
        ticket = secrets.token_bytes(16)
        receiver.expect(ticket, [1, 2, 4], 2, PROMPT, PAGE, 2)
        return RankStreamPlan("127.0.0.1", (port or receiver.port,), ticket, None, PROMPT,
                              PAGE, 2)

    # success: rank 0 reads (and deletes) the follower's report for the trailer
    ok = plan()
    bands = prefill.leader(1, ok)
    prefill.send_final(1, ok)
    sent = collect(bands)
    assert sent.error is None and sum(sent.frames) > 0
    landed = receiver.complete(ok.ticket, sent.frames[0], 10.0)
    assert landed.code is None and landed.checksums == sent.checksums
    prefill.follower.handle(DropBands(1))

    # aborted after the final part, the report already written: DropBands deletes it
    written = plan()
    prefill.leader(2, written).drop()
    prefill.send_final(2, written)
    wait_for(store, [sent_key(2, 1)], 30.0)
    prefill.follower.handle(DropBands(2))

    # aborted after the final part while it may still be written: it is not set afterwards
    racing = plan()
    prefill.leader(3, racing).drop()
    prefill.send_final(3, racing)
    prefill.follower.handle(DropBands(3))
    prefill.settle()

    # failed: the decode rank is unreachable; rank 0 reads the error and fails the handoff
    unreachable = plan(closed_port())
    bands = prefill.leader(4, unreachable)
    prefill.send_final(4, unreachable)
    with pytest.raises(RuntimeError, match="unreachable"):
        collect(bands)
    prefill.follower.handle(DropBands(4))

    # timed out: rank 0 gave up on a follower that reports only afterwards
    late = plan()
    prefill.streams = dataclasses.replace(prefill.streams, report_timeout_s=0.2)
    bands = prefill.leader(5, late)
    with pytest.raises(TimeoutError):
        collect(bands)
    prefill.send_final(5, late)
    wait_for(store, [sent_key(5, 1)], 30.0)
    prefill.follower.handle(DropBands(5))

    prefill.settle()
    assert keys_left(store, range(1, 6)) == []
    assert store.num_keys() == 0
    prefill.close()
